"""The decode step's FP8 weight GEMMs on this GPU: per-token quant + cuBLAS `_scaled_mm` (the
path above kernels/fp8_linear.MAX_ROWS) against kernels/fp8_linear.py's W8A8 tiles.

    python -m bench.fp8_gemm_bench [--batches 32,64,128] [--shapes o,down] [--warps 4,8]
        [--stages 3,4] [--block-m 0,128] [--tiles 64x128,128x128] [--out FILE]

(Split-K, K's tiles spread over several programs per output tile, was measured with this
script at commit 1925ec2 and dropped: bench/results/fp8_gemm_split_k_h100x1.json.)

Llama-3.1-8B's decoder-layer shapes (lm_head stays bf16), weights e4m3 with per-row scales,
x bf16. Timed as bench/gemm_bench.py times: graphs of calls cycling through more weight
copies than L2 holds. Reported per call: microseconds and weight bandwidth (weight bytes /
time); every output is checked against a float32 product first. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from bench.gemm_bench import CALLS, SHAPES, time_graph
from bench.models import SHAPES as MODEL_SHAPES
from kernels.fp8_linear import fp8_linear_small
from kernels.fp8_quant import per_token_quant
from pd_cluster.models.fp8 import quantize_weight

TILES = [(32, 256), (32, 512), (64, 256), (64, 128), (128, 128), (128, 256), (16, 512)]


def layer_shapes(cfg: dict, tp: int) -> dict:
    """A decoder layer's GEMMs (N, K) on one of `tp` ranks: column-parallel qkv and gate_up,
    row-parallel o and down."""
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * head_dim // tp, hidden),
            "o": (hidden, heads * head_dim // tp),
            "gate_up": (2 * inter // tp, hidden), "down": (hidden, inter // tp)}


def quant(x, w):
    return per_token_quant(x)


def scaled_mm(xq, w):
    """Pre-quantized x (xq, x_scale): cuBLAS alone."""
    w8, scale = w
    return torch._scaled_mm(xq[0], w8.t(), scale_a=xq[1], scale_b=scale.view(1, -1),
                            out_dtype=torch.bfloat16)


def cublas(x, w):
    return scaled_mm(per_token_quant(x), w)


def variants(warps, stages, block_ms) -> dict:
    """label -> (fn, takes pre-quantized x). (A W8A16 variant, w8 widened to x's 16 bits, was
    measured here too and dropped: bench/results/fp8_gemm_h100x1.json.) "shipped": the
    launcher's own tiles. block_ms: rows per program (0: the launcher's, all rows up to 64)."""
    out = {"quant alone": (quant, False), "scaled_mm alone": (scaled_mm, True),
           "quant+scaled_mm": (cublas, False),
           "w8a8 shipped": (lambda x, w: fp8_linear_small(x[0], x[1], w[0], w[1],
                                                          torch.bfloat16), True)}
    for bm in block_ms:
        for bn, bk in TILES:
            for wp in warps:
                for st in stages:
                    label = f"w8a8 n{bn} k{bk} w{wp} s{st}" + (f" m{bm}" if bm else "")
                    out[label] = ((lambda bn, bk, wp, st, bm: lambda x, w: fp8_linear_small(
                        x[0], x[1], w[0], w[1], torch.bfloat16, block_n=bn, block_k=bk,
                        num_warps=wp, num_stages=st, block_m=bm or None))(bn, bk, wp, st, bm),
                        True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--block-m", default="0", help="rows per program to try (0: the "
                    "launcher's); those above M are skipped")
    ap.add_argument("--tiles", default=None, help="BLOCK_N x BLOCK_K pairs, e.g. 64x128,128x128 "
                    "(default: TILES)")
    ap.add_argument("--model", default=None, help="a bench/models.py shape whose decoder "
                    "layer's GEMMs replace the 8B ones (with --tp: one rank's share)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.model:
        SHAPES.clear()
        SHAPES.update(layer_shapes(MODEL_SHAPES[args.model], args.tp))
    ints = lambda text: tuple(map(int, text.split(",")))  # noqa: E731
    if args.tiles:
        TILES[:] = [tuple(map(int, t.split("x"))) for t in args.tiles.split(",")]
    table = variants(ints(args.warps), ints(args.stages), ints(args.block_m))
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "calls_per_graph": CALLS, "rows": []}
    for name, (n, k) in SHAPES.items():
        if name not in args.shapes.split(","):
            continue
        copies = max(2, -(-(400 << 20) // (n * k)))
        weights = [quantize_weight(torch.randn(n, k, device="cuda") * k ** -0.5)
                   for _ in range(copies)]
        ws = [weights[i % copies] for i in range(CALLS)]
        for m in map(int, args.batches.split(",")):
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(CALLS)]
            xqs = [per_token_quant(x) for x in xs]
            w8, scale = ws[0]
            ref = xs[0].float() @ (w8.float() * scale[:, None]).T
            row = {"shape": name, "M": m, "N": n, "K": k}
            for label, (fn, a8) in table.items():
                if " m" in label and int(label.rsplit(" m", 1)[1]) > max(16, m):
                    continue
                inputs = xqs if a8 else xs
                try:
                    if not label.startswith("quant alone"):
                        err = ((fn(inputs[0], ws[0]).float() - ref).norm() / ref.norm()).item()
                        if not err < 5e-2:
                            row[label] = {"error": err}
                            continue
                    us = time_graph(fn, inputs, ws)
                except (triton.runtime.errors.OutOfResources, RuntimeError) as e:
                    row[label] = {"error": str(e)[:80]}
                    continue
                row[label] = {"us": round(us, 2), "TBps": round(n * k / us / 1e6, 3)}
            timed = sorted((v["us"], lab) for lab, v in row.items()
                           if isinstance(v, dict) and "us" in v and lab[:2] == "w8")
            row["best"] = timed[:4]
            res["rows"].append(row)
            print(f"{name:8s} M={m:4d} quant {row['quant alone'].get('us')} scaled_mm "
                  f"{row['scaled_mm alone'].get('us')} both {row['quant+scaled_mm'].get('us')}"
                  f" shipped {row['w8a8 shipped'].get('us')} | best {timed[:3]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
