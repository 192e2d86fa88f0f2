"""The tensor-parallel all-reduce at decode sizes: the peer-memory kernels against NCCL.

    python -m bench.all_reduce_bench [--world 2] [--sizes 64k,512k,1m,2m,4m,8m] [--calls 64]

One process per GPU. For each message size (bf16): every rank's result is checked against the
sum of all ranks' inputs added in fp32 in rank order (bit for bit) and against NCCL's, then
`--calls` all-reduces are captured in one CUDA graph (as a decode step's graph holds them)
and its replays timed with events: the median over 10 replays, per call. The kernels: push
(up to its slot size), one-shot and two-shot after a barrier, and the engine's choice
(`peer_us`). Then the all-reduce fused with the residual add and RMSNorm, by push and by
barrier, at decode shapes (rows x hidden). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import queue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pd_cluster.tp_workers import free_tcp_port

UNITS = {"k": 1 << 10, "m": 1 << 20}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def time_graph(fn, calls: int) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times[2:])[len(times[2:]) // 2]


NORM_SHAPES = [(64, 4096), (128, 4096), (64, 8192), (128, 8192)]   # 8B and 70B, batch 64/128


def time_norms(peer, rank: int, world: int, shape: tuple[int, int], calls: int) -> dict:
    """The fused all-reduce + residual add + RMSNorm, by push and by barrier: us per call."""
    rows, hidden = shape
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.rand(hidden, device="cuda").to(x.dtype)
    common = (x, residual, weight, 1e-5, False)
    return {"rows": rows, "hidden": hidden,
            "push_us": time_graph(lambda: peer._push.push_all_reduce_rms_norm(
                *common, peer.push_bytes // 2, rank, world, peer.push_ptrs, peer.push_counters,
                peer.failed), calls),
            "barrier_us": time_graph(lambda: peer._kernels.peer_all_reduce_rms_norm(
                *common, peer.max_bytes // 2, rank, world, peer.sig_ptrs, peer.norm_ptrs,
                peer.counters, peer.failed), calls)}


def rank_main(rank: int, world: int, port: int, sizes: list[int], calls: int, out) -> None:
    from pd_cluster.peer_all_reduce import PeerAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    gloo = dist.new_group(list(range(world)), backend="gloo")
    dist.all_reduce(torch.zeros(1, device="cuda"))
    peer = PeerAllReduce(rank, world, torch.device("cuda", rank), gloo)
    rows = []
    for size in sizes:
        n = size // 2
        inputs = [torch.randn(n, generator=torch.Generator().manual_seed(size * 10 + r))
                  .to(torch.bfloat16).cuda() for r in range(world)]
        expected = torch.zeros(n, dtype=torch.float32, device="cuda")
        for x in inputs:
            expected += x.float()
        expected = expected.to(torch.bfloat16)
        row = {"bytes": size}
        pushes = size <= peer.push_bytes
        if pushes:
            got = inputs[rank].clone()
            peer._push.push_all_reduce(got, got, peer.push_bytes // 2, rank, world,
                                       peer.push_ptrs, peer.push_counters, peer.failed)
            row["push_exact"] = bool(torch.equal(got, expected))
        for two_shot in (False, True):
            got = inputs[rank].clone()
            peer._kernels.peer_all_reduce(got, got, peer.max_bytes // 2, rank, world,
                                          peer.sig_ptrs, peer.data_ptrs, peer.red_ptrs,
                                          peer.counters, peer.failed, two_shot)
            key = "two_shot" if two_shot else "one_shot"
            row[f"{key}_exact"] = bool(torch.equal(got, expected))
        nccl = inputs[rank].clone()
        dist.all_reduce(nccl)
        row["nccl_max_abs_diff"] = (nccl.float() - expected.float()).abs().max().item()
        x = inputs[rank].clone()
        row["peer_us"] = time_graph(lambda: peer(x), calls)   # the engine's choice by size
        for two_shot in (False, True):
            row["two_shot_us" if two_shot else "one_shot_us"] = time_graph(
                lambda: peer._kernels.peer_all_reduce(
                    x, x, peer.max_bytes // 2, rank, world, peer.sig_ptrs, peer.data_ptrs,
                    peer.red_ptrs, peer.counters, peer.failed, two_shot), calls)
        if pushes:
            row["push_us"] = time_graph(lambda: peer._push.push_all_reduce(
                x, x, peer.push_bytes // 2, rank, world, peer.push_ptrs, peer.push_counters,
                peer.failed), calls)
        row["nccl_us"] = time_graph(lambda: dist.all_reduce(x), calls)
        row["nccl_over_peer"] = row["nccl_us"] / row["peer_us"]
        rows.append(row)
    norms = [time_norms(peer, rank, world, shape, calls) for shape in NORM_SHAPES]
    row = {"peer_lost": peer.peer_lost()}
    if rank == 0:
        out.put({"world": world, "device": torch.cuda.get_device_name(),
                 "calls_per_graph": calls, "dtype": "bfloat16", "sizes": rows,
                 "add_rms_norm": norms, **row})
    dist.barrier()
    peer.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="64k,256k,512k,1m,2m,4m,8m")
    ap.add_argument("--calls", type=int, default=64)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_tcp_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, sizes, args.calls, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    while True:
        try:
            result = out.get(timeout=1)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed")
    for p in procs:
        p.join(60)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
