"""Experiment: fp8 decode attention with K and V loaded as int32 words and widened four
e4m3 at a time (kernels/paged.py load_widened_e4m3), against V widened by PTX per pair (the
kernel before) and Triton's own conversion, with the same kernel over bf16 alongside.

    PYTHONPATH=. python bench/decode_fp8_words.py [--cases 64x1024,256x1024]

words: 0 = K by Triton, V by PTX per pair; 1 = V by words; 2 = K and V by words.
Prints JSON rows (us, GB/s of K and V bytes, max abs error against words 0's output).
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
    args = ap.parse_args()
    rows = []
    scale = torch.tensor([0.05, 0.05], device="cuda")
    for batch, ctx in (tuple(map(int, c.split("x"))) for c in args.cases.split(",")):
        blocks = batch * ctx // BLK
        table = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        lens[::3] -= 37         # ragged last tiles too
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        kb = torch.randn(blocks, BLK, KVH, D, device="cuda", dtype=torch.bfloat16)
        vb = torch.randn_like(kb)
        ms = triton.testing.do_bench(lambda: decode_attention(q, kb, vb, table, lens, D ** -0.5,
                                                              ctx, out=out))
        rows.append({"batch": batch, "context": ctx, "dtype": "bf16", "us": ms * 1e3,
                     "GBps": 4 * kb.numel() / ms / 1e6})
        k8, v8 = (kb / 0.05).to(torch.float8_e4m3fn), (vb / 0.05).to(torch.float8_e4m3fn)
        kb = vb = None
        ref = decode_attention(q, k8, v8, table, lens, D ** -0.5, ctx, kv_scale=scale, words=0)
        for words, knobs in itertools.product((0, 1, 2), [{}] + [
                dict(block_n=bn, num_stages=st) for bn, st in itertools.product((64, 128),
                                                                                (2, 3, 4))]):
            try:
                ms = triton.testing.do_bench(lambda: decode_attention(
                    q, k8, v8, table, lens, D ** -0.5, ctx, out=out, kv_scale=scale,
                    words=words, **knobs))
            except Exception as e:      # a setting Triton cannot compile
                rows.append({"batch": batch, "context": ctx, "words": words, **knobs,
                             "error": repr(e)[:200]})
                continue
            rows.append({"batch": batch, "context": ctx, "dtype": "fp8", "words": words, **knobs,
                         "us": ms * 1e3, "GBps": 2 * k8.numel() / ms / 1e6,
                         "max_abs_err": float((out.float() - ref.float()).abs().max())})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
