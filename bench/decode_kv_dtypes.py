"""Paged decode attention over a bf16 cache against an fp8 one, same shapes (Llama-3.1-8B
attention: 32 query heads, 8 KV heads, head_dim 128, block 16); prints one JSON object.

    python -m bench.decode_kv_dtypes [--cases 64x2048,128x2048] [--sweep]

Times are medians of triton.testing.do_bench; GB/s counts the K and V bytes the batch reads.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from kernels.decode_attention import decode_attention


def case(batch: int, context: int, fp8: bool, **knobs) -> dict:
    heads, kv_heads, dim, block = 32, 8, 128, 16
    blocks = batch * context // block
    k = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = torch.tensor([0.05, 0.05], device="cuda") if fp8 else None
    if fp8:
        k, v = (k / 0.05).to(torch.float8_e4m3fn), (v / 0.05).to(torch.float8_e4m3fn)
    table = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ms = triton.testing.do_bench(lambda: decode_attention(
        q, k, v, table, lens, dim ** -0.5, context, out=out, kv_scale=scale, **knobs))
    nbytes = 2 * k.numel() * k.element_size()
    return {"batch": batch, "context": context, "kv": "fp8" if fp8 else "bf16",
            "ms": ms, "GBps": nbytes / ms / 1e6, **knobs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x2048,128x2048,256x1024")
    ap.add_argument("--sweep", action="store_true", help="fp8: block_n x num_splits x "
                    "num_warps x num_stages, the fastest per case")
    args = ap.parse_args()
    cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    rows = [case(*c, fp8) for c in cases for fp8 in (False, True)]
    if args.sweep:
        import itertools
        for c in cases:
            tried = [case(*c, True, block_n=n, num_splits=s, num_warps=w, num_stages=st)
                     for n, s, w, st in itertools.product((64, 128), (None, 2, 4), (4, 8),
                                                          (2, 3, 4))]
            rows.append({"best_fp8": min(tried, key=lambda r: r["ms"])})
    print(json.dumps({"device": torch.cuda.get_device_name(), "decode": rows}, indent=1))


if __name__ == "__main__":
    main()
