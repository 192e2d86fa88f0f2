"""Decode attention at one shape, launched three times and nothing else: a target for
Nsight Compute (Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, block 16,
shuffled pages, every sequence at CONTEXT tokens).

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        -k regex:stage1 -s 2 -c 1 python bench/attn_once.py BATCH CONTEXT {fp8,bf16}
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.decode_attention import decode_attention  # noqa: E402


def main(batch: int, context: int, kv_dtype: str) -> None:
    heads, kv_heads, dim, page = 32, 8, 128, 16
    blocks = batch * context // page
    k = torch.randn(blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = None
    if kv_dtype == "fp8":
        scale = torch.tensor([0.02, 0.02], device="cuda")
        k, v = (k / 0.02).to(torch.float8_e4m3fn), (v / 0.02).to(torch.float8_e4m3fn)
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for _ in range(3):
        decode_attention(q, k, v, table, lens, dim ** -0.5, context, out=out, kv_scale=scale)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
