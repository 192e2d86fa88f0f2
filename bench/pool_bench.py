"""The KV pool's same-node fast path on one GPU: GPU -> pool and pool -> GPU bandwidth of a
prompt's blocks, and pooled-mode TTFT against push-mode (disaggregated) TTFT in the same run,
with P and D sharing the GPU and the pool on the same node. Prints one JSON object.

    python3 -m bench.pool_bench --out bench/results/pool_bench_h200.json   # GPU: 2048 tokens, 8B
    python3 -m bench.pool_bench --cpu --tokens 256 --reps 2   # a CPU smoke run, tiny model

Bandwidth: the pool is a DistributedKVCache actor (another process) with its shared segment;
this process maps it (pinned) and holds an engine-shaped KV cache on the device: each
direction is timed as an engine's PoolClient does it (begin, copy, confirm: `total`) and the
copy alone (`copy`). GB/s are 1e9 bytes of KV (every layer's K and V) per second, medians
over --iters after one warm-up. --transport-too adds the same through the transport (NIXL,
the path the fast one replaces) for comparison.
TTFT: median over --reps fresh random prompts (two warm-ups) of --tokens tokens, through the
router's client, 1 P + 1 D each with --gpu-share of the GPU; push mode first, then pooled.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import ray
import torch

from actors.kv_pool import node_id, start_pool
from actors.pool_client import BlockingPoolClient
from actors.pool_index import prompt_keys
from actors.pool_shm import SharedSegment, copy_blocks
from bench.models import SHAPES, dummy_model_dir
from bench import pd_bench
from pd_cluster.config import ModelConfig
from pd_cluster.kv_layout import KVLayout
from router.app import start_client
from router.app_config import AppConfig
from router.routing import Route
from transfer.registry import make_transport


def layout_of(shape: str, tokens: int, block_size: int) -> KVLayout:
    """Room for two prompts of `tokens` tokens, in the model's KV shape."""
    cfg = SHAPES[shape]
    return KVLayout(model=shape, dtype="bfloat16", num_layers=cfg["num_hidden_layers"],
                    num_blocks=2 * -(-tokens // block_size), block_size=block_size,
                    num_kv_heads=cfg["num_key_value_heads"],
                    head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])


def _rate(seconds: list[float], nbytes: int) -> dict:
    med = statistics.median(seconds)
    return {"median_ms": med * 1e3, "gb_s": nbytes / med / 1e9}


def bandwidth(args: argparse.Namespace, device: str) -> dict:
    """GPU (or CPU) -> pool and back through the pool's shared segment, one prompt's blocks."""
    layout = layout_of(args.shape, args.tokens, args.block_size)
    pool = start_pool(layout, args.transport, shared_memory=True, on_node=node_id())
    kv = torch.randn(layout.shape, device=device).to(layout.torch_dtype)
    seg = SharedSegment.attach(ray.get(pool.shared.remote()), node_id())
    if seg is None:
        raise RuntimeError("the pool's shared segment could not be mapped here")
    n = -(-args.tokens // args.block_size)
    nbytes = n * layout.block_bytes * 2 * layout.num_layers
    out = torch.zeros_like(kv)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    put = {"copy": [], "total": []}
    get = {"copy": [], "total": []}
    for i in range(args.iters + 1):
        keys = prompt_keys(f"b{i}", list(range(i * 7919, i * 7919 + args.tokens)),
                           args.block_size)
        ours = list(range(n))
        t0 = time.perf_counter()
        grant = ray.get(pool.begin_put.remote("bench", keys))
        t1 = time.perf_counter()
        copy_blocks(kv, seg.kv, [ours[j] for j in grant.positions], grant.block_ids)
        t2 = time.perf_counter()
        ray.get(pool.end_local.remote(grant.transfer_id, True))
        t3 = time.perf_counter()
        grant = ray.get(pool.begin_get.remote("bench", keys))
        t4 = time.perf_counter()
        copy_blocks(seg.kv, out, grant.block_ids, list(range(n, 2 * n)))
        t5 = time.perf_counter()
        ray.get(pool.end_local.remote(grant.transfer_id, True))
        t6 = time.perf_counter()
        if i:   # the first is a warm-up
            put["copy"].append(t2 - t1)
            put["total"].append(t3 - t0)
            get["copy"].append(t5 - t4)
            get["total"].append(t6 - t3)
    sync()
    exact = torch.equal(out[:, :, n:2 * n], kv[:, :, :n])
    res = {"prompt_tokens": args.tokens, "kv_bytes": nbytes, "exact": exact,
           "segment_pinned": seg.pinned,
           "gpu_to_pool": {k: _rate(v, nbytes) for k, v in put.items()},
           "pool_to_gpu": {k: _rate(v, nbytes) for k, v in get.items()}}
    if args.transport_too:
        res["through_transport"] = _through_transport(args, pool, kv, layout, nbytes)
    ray.kill(pool)
    return res


def _through_transport(args, pool, kv, layout, nbytes) -> dict:
    """The same blocks through the pool's transport (BlockingPoolClient), for comparison."""
    tr = make_transport(args.transport, timeout_s=120.0, lease_s=30.0)
    tr.register(kv, layout)
    client = BlockingPoolClient(pool, tr)
    n = -(-args.tokens // args.block_size)
    put, get = [], []
    for i in range(3):
        keys = prompt_keys(f"t{i}", list(range(-i * 7919 - args.tokens, -i * 7919)),
                           args.block_size)
        t0 = time.perf_counter()
        client.put(keys, list(range(n)))
        t1 = time.perf_counter()
        client.get(keys, list(range(n, 2 * n)))
        t2 = time.perf_counter()
        if i:
            put.append(t1 - t0)
            get.append(t2 - t1)
    tr.close()
    return {"gpu_to_pool": _rate(put, nbytes), "pool_to_gpu": _rate(get, nbytes)}


def serving_ttft(mode: str, args: argparse.Namespace, model: str, device: str) -> dict:
    """TTFT of fresh prompts through 1 P + 1 D sharing the device, in `mode`."""
    engine = {"model": model, "load_format": "dummy", "dtype": args.dtype,
              "max_model_len": max(4096, 2 * args.tokens), "max_num_batched_tokens": 8192}
    if device == "cuda":
        engine["gpu_memory_utilization"] = args.gpu_share * 0.9
    config = AppConfig.from_args({"mode": mode, "transport": args.transport, "engine": engine,
                                  "limits": {"max_tokens": 16},
                                  "kv_pool": {"capacity_bytes": int(args.pool_gb * 2**30)}})
    gpus = args.gpu_share if device == "cuda" else 0
    opts = {role: {"num_gpus": gpus, "num_cpus": 0} for role in ("prefill", "decode")}
    client = start_client(config, config.engine, opts)

    async def go() -> dict:
        await client.wait_ready(900)
        t = await pd_bench.ttft(client, Route(0, 0), args.tokens, args.reps)
        return {"ttft_ms": [x * 1e3 for x in t], "ttft_median_ms": statistics.median(t) * 1e3}
    try:
        return asyncio.run(go())
    finally:
        pools = list(getattr(client.handoff, "pools", {}).values())
        for a in [*client.prefill, *client.decode, *pools]:
            ray.kill(a)
        time.sleep(3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="CPU smoke run with a tiny model")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10, help="bandwidth repetitions")
    ap.add_argument("--reps", type=int, default=8, help="TTFT repetitions per mode")
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--transport-too", action="store_true",
                    help="also time the pool through the transport (the slow path)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-share", type=float, default=0.5, help="GPU share of P and of D")
    ap.add_argument("--pool-gb", type=float, default=None,
                    help="KV pool size for the pooled TTFT (default: 8 on a GPU, 0.25 on a CPU)")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    args.pool_gb = args.pool_gb or (0.25 if args.cpu else 8.0)
    args.shape = "tiny-llama" if args.cpu else "llama-3.1-8b"
    model = dummy_model_dir(args.shape)
    ray.init(log_to_driver=False)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "model_shape": args.shape, "transport": args.transport,
           "bandwidth": bandwidth(args, device)}
    if not args.skip_ttft:
        pd_bench.VOCAB[0] = ModelConfig.from_dir(model).vocab_size   # its random prompts
        push = serving_ttft("disaggregated", args, model, device)
        pooled = serving_ttft("pooled", args, model, device)
        res["ttft"] = {"push": push, "pooled": pooled,
                       "pooled_over_push": pooled["ttft_median_ms"] / push["ttft_median_ms"]}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:   # NIXL logs to stdout too: the file holds the JSON alone
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
