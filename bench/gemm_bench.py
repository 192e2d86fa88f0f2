"""The decode step's weight GEMMs on this GPU: cuBLAS (torch) against kernels/linear.py.

    python -m bench.gemm_bench [--batches 64,128,256] [--out FILE]

Llama-3.1-8B shapes (qkv, o, gate_up, down, lm_head), bf16. Each variant is captured in a
CUDA graph of several calls that cycle through copies of the weight (more bytes than L2
holds, so every call streams its weight from memory, as in a real step) and the graph's
replays are timed. Reported per call: microseconds, weight bandwidth (weight bytes / time)
and TFLOP/s; every output is checked against an fp32 product first. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from kernels.linear import linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
TRITON_CONFIGS = [{}] + [dict(block_n=bn, block_k=bk) for bn, bk in ((32, 256), (128, 128),
                                                                     (64, 128), (64, 256))]
CALLS = 8


def time_graph(fn, xs, ws) -> float:
    """Median microseconds per call of fn over the (x, w) pairs, replayed as one graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for x, w in zip(xs, ws):
            fn(x, w)                        # compile / pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws):
            fn(x, w)
    return triton.testing.do_bench(graph.replay, warmup=20, rep=100,
                                   return_mode="median") * 1e3 / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "calls_per_graph": CALLS, "rows": []}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(400 << 20) // (n * k * 2)))   # > 8x an H200's 50 MB of L2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * k ** -0.5
                   for _ in range(copies)]
        ws = [weights[i % copies] for i in range(CALLS)]
        for m in map(int, args.batches.split(",")):
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(CALLS)]
            ref = (xs[0].float() @ ws[0].float().T)
            variants = {"cublas": lambda x, w: F.linear(x, w)}
            variants.update({
                "triton " + (",".join(f"{key}={v}" for key, v in cfg.items()) or "tiles(K)"):
                (lambda cfg: lambda x, w: linear(x, w, **cfg))(cfg)
                for cfg in TRITON_CONFIGS})
            row = {"shape": name, "M": m, "N": n, "K": k}
            for label, fn in variants.items():
                try:
                    err = ((fn(xs[0], ws[0]).float() - ref).norm() / ref.norm()).item()
                except triton.runtime.errors.OutOfResources:
                    continue
                if not err < 1e-2:
                    row[label] = {"error": err}
                    continue
                us = time_graph(fn, xs, ws)
                row[label] = {"us": round(us, 2), "TBps": round(n * k * 2 / us / 1e6, 3),
                              "TFLOPs": round(2 * m * n * k / us / 1e6, 1)}
            best = min((v["us"], lab) for lab, v in row.items()
                       if isinstance(v, dict) and "us" in v and lab.startswith("triton"))
            row["best_triton"] = best[1]
            res["rows"].append(row)
            default = row["triton tiles(K)"]["us"]
            print(f"{name:8s} M={m:4d} cublas {row['cublas']['us']:8.2f} us "
                  f"{row['cublas']['TBps']:.2f} TB/s | tiles(K) {default:8.2f} us "
                  f"| best triton {best[0]:8.2f} us "
                  f"{n * k * 2 / best[0] / 1e6:.2f} TB/s  {best[1]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
