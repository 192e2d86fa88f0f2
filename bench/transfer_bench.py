"""KV transfer bandwidth between two Ray actors (one GPU each with --devices cuda), and through
the DistributedKVCache (engine → pinned host pool → engine). Prints one JSON object.

    python3 -m bench.transfer_bench --backend nixl --devices cuda --block-size 16
    python3 -m bench.transfer_bench --backend nixl --devices cpu --tokens 512 --iters 5
    python3 -m bench.transfer_bench --post-overhead --devices cpu --kv-heads 1 --head-dim 1

Model shape defaults to Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16): a 2048-token
prompt is 256 MiB of KV. GB/s are 1e9 bytes per second of KV moved, timed on the sender from
posting the transfer to its completion (for two-sided backends: the receiver's ACK).
per_layer_spaced posts one layer's write every --gap-ms, as a prefill does after each layer,
and reports each write's post-to-done time (GB/s: one layer's bytes over its median).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

from actors.kv_pool import DistributedKVCache
from actors.pool_client import BlockingPoolClient
from pd_cluster.kv_layout import KVLayout
from transfer.registry import make_transport


class Side:
    """One engine's KV pool (random contents) and transport, inside a Ray actor."""

    def __init__(self, backend: str, layout: KVLayout, device: str, seed: int):
        torch.manual_seed(seed)
        self.kv = torch.randn(layout.shape, device=device).to(layout.torch_dtype) if seed \
            else layout.allocate(device)
        self.t = make_transport(backend, timeout_s=120.0, lease_s=30.0)
        self.t.register(self.kv, layout)
        self.blocks = list(range(layout.num_blocks))

    def descriptor(self) -> bytes:
        return self.t.descriptor().encode()

    def settings(self) -> dict | None:
        """The UCX parameters NIXL was given (None for other backends)."""
        return getattr(self.t, "ucx_params", None)

    def connect(self, desc: bytes) -> str:
        return self.t.connect(desc)

    def serve(self, peer: str, tids: list[str]) -> None:
        """Receiver: track (and for two-sided backends, carry out) the sender's transfers."""
        for tid in tids:
            t = self.t.expect(peer, tid)
            self.t.wait(t)
            self.t.release(t)

    def push(self, peer: str, tids: list[list[str]], layer_ranges: list[range]) -> list[float]:
        """Seconds per round; each round posts one write per layer range, then waits for all."""
        times = []
        for round_tids in tids:
            start = time.perf_counter()
            ts = [self.t.write(peer, self.blocks, self.blocks, r, transfer_id=tid)
                  for tid, r in zip(round_tids, layer_ranges)]
            for t in ts:
                self.t.wait(t)
            times.append(time.perf_counter() - start)
            for t in ts:
                self.t.release(t)
        return times

    def spaced(self, peer: str, tids: list[list[str]], gap_s: float) -> list[list[float]]:
        """Per round, one write per layer posted `gap_s` apart (as a prefill computes its
        layers), polling the ones in flight meanwhile: seconds from each post to its DONE."""
        rounds = []
        for round_tids in tids:
            posted, done, ts = [], {}, []
            t0 = time.perf_counter()
            for i, tid in enumerate(round_tids):
                while time.perf_counter() < t0 + i * gap_s:
                    self._note_done(ts, done)
                ts.append(self.t.write(peer, self.blocks, self.blocks, range(i, i + 1),
                                       transfer_id=tid))
                posted.append(time.perf_counter())
            deadline = time.monotonic() + 60
            while len(done) < len(ts) and time.monotonic() < deadline:
                self._note_done(ts, done)
            for t in ts:
                t.raise_if_failed()
                self.t.release(t)
            rounds.append([done[i] - posted[i] for i in range(len(ts))])
        return rounds

    def _note_done(self, ts: list, done: dict) -> None:
        for i, t in enumerate(ts):
            if i not in done and self.t.poll(t).finished:
                done[i] = time.perf_counter()

    def pool_round_trip(self, pool, iters: int) -> tuple[list[float], list[float]]:
        client = BlockingPoolClient(pool, self.t)
        puts, gets = [], []
        for i in range(iters):
            keys = [(i << 32) | b for b in self.blocks]  # fresh prefix hashes: nothing cached
            start = time.perf_counter()
            client.put(keys, self.blocks)
            puts.append(time.perf_counter() - start)
            start = time.perf_counter()
            client.get(keys, self.blocks)
            gets.append(time.perf_counter() - start)
        return puts, gets

    def checksum(self) -> int:
        return int(self.kv.view(-1).view(torch.int16).to(torch.int64).sum())


def _rates(seconds: list[float], nbytes: int, warmup: int) -> dict:
    s = seconds[warmup:]
    return dict(gbps_median=round(nbytes / statistics.median(s) / 1e9, 2),
                gbps_best=round(nbytes / min(s) / 1e9, 2),
                ms_median=round(statistics.median(s) * 1e3, 3))


def _tids(prefix: str, rounds: int, per_round: int) -> list[list[str]]:
    return [[f"{prefix}-{r}-{i}" for i in range(per_round)] for r in range(rounds)]


def _layout(args: argparse.Namespace) -> KVLayout:
    return KVLayout("llama-3.1-8b-shape", args.dtype, args.layers,
                    -(-args.tokens // args.block_size), args.block_size, args.kv_heads,
                    args.head_dim)


def pool_only(args: argparse.Namespace) -> dict:
    """One engine's pool (GPU or host) against a DistributedKVCache: the host path alone,
    on one GPU. --pool-progress-thread gives the pool's NIXL agent its progress thread."""
    layout = _layout(args)
    device = "cuda" if args.devices == "cuda" else "cpu"
    side = ray.remote(num_cpus=0, num_gpus=0.9 if device == "cuda" else 0)(Side).remote(
        args.backend, layout, device, 1)
    options = {"progress_thread": True} if args.pool_progress_thread else None
    pool = ray.remote(num_cpus=0, max_concurrency=8)(DistributedKVCache).remote(
        layout, args.backend, timeout_s=120.0, lease_s=30.0, transport_options=options)
    nbytes = layout.block_bytes * 2 * layout.num_layers * layout.num_blocks
    puts, gets = ray.get(side.pool_round_trip.remote(pool, args.warmup + args.iters))
    return dict(backend=args.backend, devices=args.devices, tokens=args.tokens,
                block_size=args.block_size, prompt_kv_bytes=nbytes,
                pool_progress_thread=args.pool_progress_thread,
                ucx_params=ray.get(side.settings.remote()),
                kv_cache_in=_rates(puts, nbytes, args.warmup),
                kv_cache_out=_rates(gets, nbytes, args.warmup))


def run(args: argparse.Namespace) -> dict:
    layout = _layout(args)
    gpus = 0.9 if args.devices == "cuda" else 0  # 0.9: two engines never share a GPU
    cls = ray.remote(num_cpus=0, num_gpus=gpus)(Side)
    device = "cuda" if args.devices == "cuda" else "cpu"
    sender, receiver = (cls.remote(args.backend, layout, device, s) for s in (1, 0))
    s_name = ray.get(receiver.connect.remote(ray.get(sender.descriptor.remote())))
    r_name = ray.get(sender.connect.remote(ray.get(receiver.descriptor.remote())))
    nbytes = layout.block_bytes * 2 * layout.num_layers * layout.num_blocks
    rounds = args.warmup + args.iters
    out = dict(backend=args.backend, devices=args.devices, tokens=args.tokens,
               block_size=args.block_size, layers=args.layers, dtype=args.dtype,
               prompt_kv_bytes=nbytes, node_gpus=torch.cuda.device_count(),
               ucx_params=ray.get(sender.settings.remote()))
    whole = [range(layout.num_layers)]
    layer = [range(i, i + 1) for i in range(layout.num_layers)]
    for name, ranges, reps in (("whole_prompt", whole, rounds), ("per_layer_pipelined", layer, rounds)):
        tids = _tids(name, reps, len(ranges))
        serving = receiver.serve.remote(s_name, [t for r in tids for t in r])
        secs = ray.get(sender.push.remote(r_name, tids, ranges))
        ray.get(serving)
        out[name] = _rates(secs, nbytes, args.warmup)
        if name == "whole_prompt":
            out["verified"] = ray.get(sender.checksum.remote()) == ray.get(receiver.checksum.remote())
    # One layer at a time, waiting for each: what a layer-by-layer push achieves per layer.
    tids = _tids("layer", rounds * 4, 1)
    serving = receiver.serve.remote(s_name, [t[0] for t in tids])
    secs = ray.get(sender.push.remote(r_name, tids, [range(0, 1)]))
    ray.get(serving)
    out["per_layer"] = _rates(secs, nbytes // layout.num_layers, args.warmup * 4)
    # As a prefill issues them: one layer's write per layer of compute (--gap-ms apart).
    tids = _tids("spaced", rounds, layout.num_layers)
    serving = receiver.serve.remote(s_name, [t for r in tids for t in r])
    lat = [x for r in ray.get(sender.spaced.remote(r_name, tids, args.gap_ms / 1e3))[args.warmup:]
           for x in r]
    ray.get(serving)
    layer_bytes = nbytes // layout.num_layers
    out["per_layer_spaced"] = dict(
        gap_ms=args.gap_ms, post_to_done_us_median=round(statistics.median(lat) * 1e6, 1),
        post_to_done_us_p90=round(sorted(lat)[int(0.9 * (len(lat) - 1))] * 1e6, 1),
        gbps_median=round(layer_bytes / statistics.median(lat) / 1e9, 1))
    if not args.skip_pool:
        pool = ray.remote(num_cpus=0, num_gpus=0.05 if gpus else 0, max_concurrency=8)(
            DistributedKVCache).remote(layout, args.backend, timeout_s=120.0, lease_s=30.0)
        puts, gets = ray.get(sender.pool_round_trip.remote(pool, rounds))
        out["kv_cache_in"], out["kv_cache_out"] = (_rates(x, nbytes, args.warmup)
                                                   for x in (puts, gets))
    return out


def post_overhead(args: argparse.Namespace, layout: KVLayout) -> dict:
    """Per-write fixed cost, in one process (no Ray): µs inside write() (the posting) and
    inside wait() (polling until done), for one whole-prompt write (its blocks contiguous, and
    scattered: one descriptor per block) and for 32 one-layer writes posted back to back. Tiny
    --kv-heads/--head-dim make the bytes negligible on CPU."""
    device = "cuda" if args.devices == "cuda" else "cpu"
    a, b = (make_transport(args.backend, timeout_s=120.0) for _ in range(2))
    a.register(layout.allocate(device), layout)
    b.register(layout.allocate(device), layout)
    peer = a.connect(b.descriptor())
    b.connect(a.descriptor())
    blocks, out = list(range(layout.num_blocks)), {}
    whole = [range(layout.num_layers)]
    # Descending block ids on both sides: no two neighbours merge, one descriptor per block
    # (what an allocator that hands out blocks in free-queue order gave once it had wrapped).
    for name, ranges, ids in (("whole_prompt", whole, blocks),
                              ("whole_prompt_one_descriptor_per_block", whole, blocks[::-1]),
                              ("per_layer", [range(i, i + 1) for i in range(layout.num_layers)],
                               blocks)):
        post, wait = [], []
        for _ in range(args.warmup + args.iters):
            ts = []
            for r in ranges:
                start = time.perf_counter()
                ts.append(a.write(peer, ids, ids, r))
                post.append(time.perf_counter() - start)
            start = time.perf_counter()
            for t in ts:   # one thread holds both ends: progress the receiver too
                while not a.poll(t).finished:
                    b.progress()
                t.raise_if_failed()
            wait.append((time.perf_counter() - start) / len(ts))
            for t in ts:
                a.release(t)
            b.progress()  # drop the DONE notices
        skip = args.warmup * len(ranges)
        out[name] = dict(post_us_median=round(statistics.median(post[skip:]) * 1e6, 1),
                         wait_us_median=round(statistics.median(wait[args.warmup:]) * 1e6, 1))
    a.close()
    b.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="nixl", choices=["nixl", "ucx", "ray"])
    p.add_argument("--devices", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gap-ms", type=float, default=1.5,
                   help="per_layer_spaced: ms between layers (a 2048-token prefill of the 8B "
                        "model: ~48 ms / 32 layers)")
    p.add_argument("--skip-pool", action="store_true", help="skip the DistributedKVCache part")
    p.add_argument("--pool-only", action="store_true",
                   help="only the DistributedKVCache part, one engine pool (one GPU)")
    p.add_argument("--pool-progress-thread", action="store_true",
                   help="--pool-only: run NIXL's progress thread in the pool's agent")
    p.add_argument("--post-overhead", action="store_true",
                   help="only the per-write posting/polling cost, in one process")
    args = p.parse_args()
    if args.post_overhead:
        print(json.dumps(post_overhead(args, _layout(args)), indent=1))
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print(json.dumps(pool_only(args) if args.pool_only else run(args), indent=1))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
