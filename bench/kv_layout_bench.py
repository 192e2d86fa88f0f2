"""Experiment: decode attention over the paged KV cache in two memory layouts, same kernel.

    PYTHONPATH=. python bench/kv_layout_bench.py [--cases 64x1024,256x1024]

NHD (the shipped layout): cache [num_blocks, block_size, num_kv_heads, head_dim], so one KV
head's rows within a block lie num_kv_heads * head_dim elements apart (1 KB for fp8 at the
8B shape). HND: [num_blocks, num_kv_heads, block_size, head_dim], so each (block, head) is
one contiguous run of block_size rows (2 KB fp8). The kernel takes strides, so HND is passed
as a permuted view and runs the same code. Prints JSON rows: layout, dtype, knobs, us, GB/s
of K and V bytes read.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.decode_attention import decode_attention  # noqa: E402

H, KVH, D, BLK = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x1024,128x1024,256x1024,64x2048,128x2048,256x2048")
    ap.add_argument("--page-sizes", default="",
                    help="instead: the NHD cache with blocks in order re-viewed as pages of "
                    "these many tokens (the same bytes, fewer block-table lookups per tile)")
    args = ap.parse_args()
    if args.page_sizes:
        return pages(args)
    rows = []
    scale = torch.tensor([0.05, 0.05], device="cuda")
    for batch, ctx in (tuple(map(int, c.split("x"))) for c in args.cases.split(",")):
        blocks = batch * ctx // BLK
        # blocks in order, as a fresh allocator hands them out (engine_bench), and shuffled,
        # as a busy one would (default knobs only)
        tables = {"ordered": torch.arange(blocks, device="cuda", dtype=torch.int32),
                  "shuffled": torch.randperm(blocks, device="cuda").to(torch.int32)}
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for dtype in ("fp8", "bf16"):
            k = torch.randn(blocks, BLK, KVH, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            if dtype == "fp8":
                k, v = (k / 0.05).to(torch.float8_e4m3fn), (v / 0.05).to(torch.float8_e4m3fn)
            kvs = scale if dtype == "fp8" else None
            nbytes = 2 * k.numel() * k.element_size()
            ref = decode_attention(q, k, v, tables["ordered"].view(batch, -1), lens, D ** -0.5,
                                   ctx, kv_scale=kvs)
            for layout in ("NHD", "HND"):
                if layout == "HND":     # the same values, each (block, head) contiguous
                    k, v = (x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                            for x in (k, v))
                knobs_list = [{}] + ([dict(block_n=bn, num_stages=st) for bn, st in
                                      itertools.product((32, 64, 128), (2, 3, 4))]
                                     if dtype == "fp8" else [])
                for (order, table), knobs in itertools.product(tables.items(), knobs_list):
                    if order == "shuffled" and knobs:
                        continue
                    table = table.view(batch, -1)
                    try:
                        ms = triton.testing.do_bench(lambda: decode_attention(
                            q, k, v, table, lens, D ** -0.5, ctx, out=out, kv_scale=kvs,
                            **knobs))
                    except Exception as e:      # a setting Triton cannot compile
                        rows.append({"batch": batch, "context": ctx, "dtype": dtype,
                                     "layout": layout, "order": order, **knobs, "error": repr(e)[:160]})
                        continue
                    # shuffled blocks hold other values: compare the ordered table only
                    err = float((out.float() - ref.float()).abs().max()) \
                        if order == "ordered" else None
                    row = {"batch": batch, "context": ctx, "dtype": dtype, "layout": layout,
                           "order": order, **knobs, "us": ms * 1e3, "GBps": nbytes / ms / 1e6, "err": err}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            k = v = None
            torch.cuda.empty_cache()
    print(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                      "rows": rows}, indent=1))


def pages(args) -> None:
    """Default knobs (and 128-token tiles) per page size, fp8 and bf16, blocks in order."""
    rows = []
    scale = torch.tensor([0.05, 0.05], device="cuda")
    for batch, ctx in (tuple(map(int, c.split("x"))) for c in args.cases.split(",")):
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        for dtype in ("fp8", "bf16"):
            k = torch.randn(batch * ctx, KVH, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            if dtype == "fp8":
                k, v = (k / 0.05).to(torch.float8_e4m3fn), (v / 0.05).to(torch.float8_e4m3fn)
            kvs = scale if dtype == "fp8" else None
            nbytes = 2 * k.numel() * k.element_size()
            ref = None
            for page in [BLK] + [int(p) for p in args.page_sizes.split(",")]:
                kp, vp = k.view(-1, page, KVH, D), v.view(-1, page, KVH, D)
                table = torch.arange(kp.shape[0], device="cuda", dtype=torch.int32)
                table = table.view(batch, -1)
                for knobs in ({}, {"block_n": 128}, {"num_warps": 8}):
                    ms = triton.testing.do_bench(lambda: decode_attention(
                        q, kp, vp, table, lens, D ** -0.5, ctx, out=out, kv_scale=kvs,
                        **knobs))
                    ref = out.clone() if ref is None else ref
                    rows.append({"batch": batch, "context": ctx, "dtype": dtype, "page": page,
                                 **knobs, "us": ms * 1e3, "GBps": nbytes / ms / 1e6,
                                 "err": float((out.float() - ref.float()).abs().max())})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            k = v = None
            torch.cuda.empty_cache()
    print(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
