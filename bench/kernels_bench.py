"""GPU benchmark of the Triton attention kernels; prints one JSON document.

    python -m bench.kernels_bench [--sweep] [--out results.json]

Decode: batch 64, context 4096, Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim
128, bf16), per KV block size. Effective bandwidth = bytes of K+V the batch must read / kernel
time (both stages). Prefill: 8 fresh prompts of 2048 tokens, causal, same heads; torch SDPA
(contiguous, non-paged) runs beside it as a yardstick. A device-to-device copy gives the
memory ceiling measured the same way. Times are medians of triton.testing.do_bench after its
warm-up; every configuration's output is checked against the torch reference first.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton


from kernels.decode_attention import decode_attention
from kernels.prefill_attention import prefill_attention
from kernels.reference import decode_attention_ref, paged_attention_ref

DECODE_SWEEP = {"block_n": [32, 64, 128], "num_splits": [None, 1, 2, 4, 8], "num_warps": [4, 8],
                "num_stages": [2, 3, 4]}
PREFILL_SWEEP = {"block_m": [64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8],
                 "num_stages": [2, 3]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--prefill-seqs", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--sweep", action="store_true",
                   help="also time grids of launch knobs (DECODE_SWEEP, PREFILL_SWEEP)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p.parse_args(argv)


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def progress(kernel: str, block_size: int, run: dict) -> None:
    """One line per timed configuration on stderr, so a cut-off sweep still shows something."""
    print(kernel, block_size, json.dumps(run), file=sys.stderr, flush=True)


def paged_inputs(args: argparse.Namespace, num_seqs: int, seq_len: int, block_size: int):
    """Random bf16 caches; each sequence owns seq_len tokens in shuffled blocks."""
    blocks_per_seq = triton.cdiv(seq_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, lens


def bench_decode(args: argparse.Namespace, block_size: int, knob_grid: list[dict]) -> dict:
    k_cache, v_cache, tables, lens = paged_inputs(args, args.batch, args.context, block_size)
    q = torch.randn(args.batch, args.num_heads, args.head_dim, dtype=torch.bfloat16,
                    device="cuda")
    scale = args.head_dim ** -0.5
    ref = decode_attention_ref(q, k_cache, v_cache, tables, lens, scale).float()
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    runs = []
    for knobs in knob_grid:
        def run() -> torch.Tensor:
            return decode_attention(q, k_cache, v_cache, tables, lens, scale, args.context,
                                    **knobs)
        try:
            err = (run().float() - ref).norm().item() / ref.norm().item()
            ms = time_ms(run)
        except triton.runtime.errors.OutOfResources as exc:  # a tile too big for this GPU
            runs.append({**knobs, "error": str(exc)})
            continue
        runs.append({**knobs, "ms": round(ms, 4), "kv_gbps": round(kv_bytes / ms / 1e6, 1),
                     "rel_err": float(f"{err:.2e}")})
        progress("decode", block_size, runs[-1])
    best = max((r for r in runs if "kv_gbps" in r), key=lambda r: r["kv_gbps"])
    del k_cache, v_cache
    return {"block_size": block_size, "kv_bytes": kv_bytes, "default": runs[0], "best": best,
            "runs": runs if len(runs) > 1 else None}


def bench_prefill(args: argparse.Namespace, block_size: int, knob_grid: list[dict]) -> dict:
    n, length, h, d = args.prefill_seqs, args.prefill_len, args.num_heads, args.head_dim
    k_cache, v_cache, tables, lens = paged_inputs(args, n, length, block_size)
    q = torch.randn(n * length, h, d, dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(0, n * length + 1, length, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, starts, scale).float()
    # The causal half of QK^T and PV: 2 matmuls x 2 flops x (L(L+1)/2) x d per head and seq.
    flops = 4 * n * h * d * length * (length + 1) / 2
    runs = []
    for knobs in knob_grid:
        def run() -> torch.Tensor:
            return prefill_attention(q, k_cache, v_cache, tables, lens, starts, length, scale,
                                     **knobs)
        try:
            err = (run().float() - ref).norm().item() / ref.norm().item()
            ms = time_ms(run)
        except triton.runtime.errors.OutOfResources as exc:
            runs.append({**knobs, "error": str(exc)})
            continue
        runs.append({**knobs, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                     "rel_err": float(f"{err:.2e}")})
        progress("prefill", block_size, runs[-1])
    # SDPA on the same tokens laid out contiguously: what a non-paged flash kernel reaches.
    k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2)   # [n, kv_heads, L, d]
    v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2)
    qs = q.view(n, length, h, d).transpose(1, 2)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True,
                                                             scale=scale, enable_gqa=True))
    return {"block_size": block_size, "default": runs[0],
            "best": max((r for r in runs if "tflops" in r), key=lambda r: r["tflops"]),
            "runs": runs if len(runs) > 1 else None, "torch_sdpa_ms": round(sdpa_ms, 4),
            "torch_sdpa_tflops": round(flops / sdpa_ms / 1e9, 1)}


def copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written, as the ceiling to compare with."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return round(2 * nbytes / time_ms(lambda: dst.copy_(src)) / 1e6, 1)


def knob_grid(sweep: dict | None) -> list[dict]:
    """The launcher's own choice first, then every combination of the sweep's values."""
    grid = [{}]
    if sweep:
        grid += [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())]
    return grid


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernels_bench needs a CUDA GPU")
    torch.manual_seed(0)
    decode_grid = knob_grid(DECODE_SWEEP if args.sweep else None)
    decode = [bench_decode(args, bs, decode_grid) for bs in args.block_sizes]
    prefill_grid = knob_grid(PREFILL_SWEEP if args.sweep else None)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "copy_gbps": copy_gbps(),
        "decode": {"batch": args.batch, "context": args.context, "num_heads": args.num_heads,
                   "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
                   "dtype": "bfloat16", "per_block_size": decode,
                   "best": max((d["best"] | {"block_size": d["block_size"]} for d in decode),
                               key=lambda r: r["kv_gbps"])},
        "prefill": [bench_prefill(args, bs, prefill_grid)
                    for bs in sorted({16, args.block_sizes[-1]})],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
