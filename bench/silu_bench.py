"""SiLU-and-mul with the FP8 down projection's per-token quantization fused in
(kernels/activation.py), at Llama-3.1-8B's intermediate size, across num_warps; prints JSON.

    PYTHONPATH=. python bench/silu_bench.py [--rows 64,128,256] [--warps 4,8,16,32]

One program per row (the row's scale needs all of it). Times are medians of
triton.testing.do_bench; GB/s counts the bf16 input read and the e4m3 output written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.activation import silu_and_mul  # noqa: E402

INTER = 14336


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--warps", default="4,8,16,32")
    args = ap.parse_args()
    rows = []
    for t in map(int, args.rows.split(",")):
        x = torch.randn(t, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        nbytes = x.numel() * 2 + t * INTER
        for w in [None, *map(int, args.warps.split(","))]:
            ms = triton.testing.do_bench(lambda: silu_and_mul(x, quantize=True, num_warps=w))
            rows.append({"rows": t, "num_warps": w or "default", "us": ms * 1e3,
                         "GBps": nbytes / ms / 1e6})
    print(json.dumps({"device": torch.cuda.get_device_name(), "silu_and_mul_fp8": rows},
                     indent=1))


if __name__ == "__main__":
    main()
