"""MLA decode attention (kernels/mla_decode.py) on this GPU against its memory roofline.

    python -m bench.mla_bench [--heads 16,128] [--batches 64,128] [--contexts 1024,4096]
        [--block-size 16] [--sweep] [--out FILE]

DeepSeek shapes, bf16 cache, one layer: kv_lora_rank L 512, RoPE dim R 64, H 16 query heads
(V2-Lite, or V3 at 16 heads a rank at TP 8) and 128 (V3 on one GPU); the engine's default
block size (pd_cluster/config.py). Every sequence of a batch holds `context` tokens.

Each configuration is captured in a CUDA graph of several calls that cycle through copies of
the cache (more bytes than L2 holds, so each call streams its cache from memory, as a real
step does) and the graph's replays are timed (bench/gemm_bench.py time_graph). Roofline: the
cache bytes a call must read (B x context x (L + R) x 2) over this machine's measured copy
rate (bytes read + written per second, bench/engine_bench.py copy_bandwidth), as the engine
benchmark's roofline. At H 128 the 8 programs of a sequence's head blocks each read its
rows: the roofline assumes L2 serves all but the first. Every configuration's output (its
first 4 sequences) is checked against the fp32 reference first. `--sweep` also times a grid
of the launcher's knobs (SWEEP). Prints JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

from bench.engine_bench import copy_bandwidth
from bench.gemm_bench import time_graph
from kernels.mla_decode import mla_decode, mla_decode_ref

LATENT, ROPE = 512, 64
DEVICE, DTYPE = "cuda", torch.bfloat16
L2_BYTES = 400 << 20        # cycle caches past 8x an H200's 50 MB of L2
CALLS = 8
# num_stages is left out: 2 to 5 compile alike (one buffer for a tile whose addresses come
# from the block table, kernels/paged.py).
SWEEP = {"block_h": [16, 32, 64], "block_n": [16, 32], "num_warps": [4, 8],
         "num_splits": [None, 1, 2, 4]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,128")
    p.add_argument("--batches", default="64,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sweep", action="store_true", help="also time the SWEEP grid of knobs")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def latent_caches(batch: int, context: int, block_size: int):
    """Copies of a bf16 cache holding `batch` sequences of `context` tokens (enough copies to
    outgrow L2), and the block table, which gives each sequence a shuffled run of blocks."""
    blocks = batch * -(-context // block_size)
    table = torch.randperm(blocks, device=DEVICE, dtype=torch.int32).view(batch, -1)
    cache_bytes = blocks * block_size * (LATENT + ROPE) * DTYPE.itemsize
    caches = [torch.randn(blocks, block_size, LATENT + ROPE, dtype=DTYPE,
                          device=DEVICE) for _ in range(max(2, -(-L2_BYTES // cache_bytes)))]
    return caches, table


def run_config(heads: int, batch: int, context: int, caches: list[torch.Tensor],
               table: torch.Tensor, copy_rate: float, **knobs) -> dict:
    """One configuration's time per call, checked against the reference first."""
    q_latent = torch.randn(batch, heads, LATENT, dtype=DTYPE, device=DEVICE)
    q_pe = torch.randn(batch, heads, ROPE, dtype=DTYPE, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(192)      # DeepSeek's qk_nope + qk_rope head dim, 128 + 64
    out = torch.empty_like(q_latent)

    def call(q, cache):
        mla_decode(q, q_pe, cache, table, lens, scale, context, out=out, **knobs)

    call(q_latent, caches[0])
    ref = mla_decode_ref(q_latent[:4], q_pe[:4], caches[0], table[:4], lens[:4], scale)
    err = (out[:4].float() - ref.float()).abs().max().item()
    assert err < 2e-2, f"max |out - ref| {err} ({heads} heads, {knobs})"
    us = time_graph(call, [q_latent] * CALLS, [caches[i % len(caches)] for i in range(CALLS)])
    read = caches[0].numel() * caches[0].element_size()
    return {**knobs, "us": round(us, 2), "cache_gb_s": round(read / us / 1e3, 1),
            "roofline_us": round(read / copy_rate * 1e6, 2),
            "of_roofline": round(read / copy_rate * 1e6 / us, 3), "max_abs_err": err}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    copy_rate = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "latent": LATENT, "rope": ROPE,
           "block_size": args.block_size, "copy_gb_s": round(copy_rate / 1e9, 1),
           "calls_per_graph": CALLS, "rows": []}
    grid = [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())]
    for batch, context in itertools.product(map(int, args.batches.split(",")),
                                            map(int, args.contexts.split(","))):
        caches, table = latent_caches(batch, context, args.block_size)
        for heads in map(int, args.heads.split(",")):
            row = {"heads": heads, "batch": batch, "context": context,
                   **run_config(heads, batch, context, caches, table, copy_rate)}
            if args.sweep:
                runs = []
                for knobs in grid:
                    try:
                        runs.append(run_config(heads, batch, context, caches, table,
                                               copy_rate, **knobs))
                    except Exception as e:      # out of shared memory or registers
                        runs.append({**knobs, "error": str(e).splitlines()[0][:200]})
                timed = [r for r in runs if "us" in r]
                row["sweep_best"] = min(timed, key=lambda r: r["us"]) if timed else None
                row["sweep"] = runs
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}),
                  file=sys.stderr, flush=True)
            res["rows"].append(row)
        del caches
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
