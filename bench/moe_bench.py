"""A MoE layer's experts on this GPU: kernels/fused_moe_triton.py against the per-expert loop
of torch matmuls (kernels/fused_moe.py's reference) and against the bytes it must move.

    python -m bench.moe_bench [--tokens 1,16,64,128,256,1024,4096] [--fp8] [--sweep] > FILE

Qwen3-30B-A3B's MoE layer, whole on one GPU: hidden 2048, 128 experts, top-8,
moe_intermediate 768, bf16 (--fp8: e4m3 weights with per-channel scales, as the FP8 layers
quantize them). Routing is uniform: each token's top-8 of random logits.

Per batch size T, reported per call:
  triton_graph_us  fused_moe, replayed in a CUDA graph of CALLS calls, each on its own routing
                   (so a small batch's experts differ from call to call, as layers' do, and
                   are not served from L2); bench/gemm_bench.py's time_graph
  triton_eager_us  the same calls launched one by one (launch overhead included)
  torch_loop_us    fused_moe_ref, launched one by one: it cannot be captured, since it asks
                   the host which experts were chosen (torch.unique(...).tolist())
  roofline_us      the bytes the layer must move over the copy rate measured here (a graphed
                   device-to-device copy, read + write bytes over time): the routed experts'
                   weights (their union over the T tokens: about E * (1 - (1 - K/E)^T)
                   experts), x read and out written. The kernels also move the gate/up, h
                   and down buffers, T*K rows each, which this bound leaves out.
  rel_err          fused_moe against the reference (relative norm): the GEMMs' accumulation
                   order apart, the same roundings (the kernel module's docstring)
  align_us         the sort alone (kernels/moe_align.py), graphed: torch's ops, and for
                   T <= 512 the one-launch kernel; fused_moe takes the latter up to
                   ONE_LAUNCH_MAX_PAIRS pairs (`align_taken` says which it took here)
With --sweep, each of SWEEP's tiles is timed too (graphed), and the fastest named. Prints
JSON on stdout, a line per batch size on stderr as it goes; a size that fails gets a row of
its error, and the others still run.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch
import triton

from bench.gemm_bench import time_graph
from kernels.fused_moe import fused_moe_ref
from kernels.fused_moe_triton import Tiles, fused_moe, tiles
from kernels.moe_align import ONE_LAUNCH_MAX_PAIRS, moe_align, moe_align_one_launch
from pd_cluster.models.fp8 import quantize_weight

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
CALLS = 4
COPY_BYTES = 1 << 30
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages) for both GEMMs (BLOCK_K doubled for FP8).
SWEEP = [(m, n, k, s) for m in (16, 32, 64) for n, k in ((64, 128), (128, 64), (128, 128))
         for s in (3, 4)]


def copy_rate() -> float:
    """Bytes read and written per microsecond by a graphed device-to-device copy."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda a, b: b.copy_(a), [src], [dst])
    return 2 * COPY_BYTES / us


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) of uniform routing: top-K of random logits, renormalized."""
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    values, ids = logits.softmax(dim=-1).topk(TOP_K, dim=-1)
    return values / values.sum(dim=-1, keepdim=True), ids


def experts(fp8: bool) -> tuple:
    """(w13, w2, w13_scale, w2_scale) of random experts; the scales None in bf16."""
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device="cuda")
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda")
    w13, w2 = w13 * HIDDEN ** -0.5, w2 * INTER ** -0.5
    if not fp8:
        return w13, w2, None, None
    (w13_q, w13_s), (w2_q, w2_s) = (quantize_weight(w.flatten(0, 1)) for w in (w13, w2))
    return (w13_q.view(w13.shape), w2_q.view(w2.shape), w13_s.view(EXPERTS, -1),
            w2_s.view(EXPERTS, -1))


def eager_us(fn, args: list) -> float:
    """Median microseconds per call of fn over the argument tuples, launched one by one."""
    def run():
        for a in args:
            fn(*a)
    return triton.testing.do_bench(run, warmup=5, rep=50, return_mode="median") * 1e3 / len(args)


def sweep_tiles(m: int, n: int, k: int, stages: int, fp8: bool) -> tuple[Tiles, Tiles]:
    """One SWEEP entry as both GEMMs' tiles."""
    cfg = Tiles(m, n, k * (2 if fp8 else 1), num_stages=stages)
    return cfg, cfg


def bench_tokens(tokens: int, weights: tuple, rate: float, fp8: bool, sweep: bool) -> dict:
    w13, w2, w13_scale, w2_scale = weights
    xs = [torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(CALLS)]
    routes = [routing(tokens) for _ in range(CALLS)]
    scales = (w13_scale, w2_scale)

    def triton_moe(x, route, config=None):
        return fused_moe(x, w13, w2, *route, 0, *scales, config=config)

    out = triton_moe(xs[0], routes[0])
    ref = fused_moe_ref(xs[0], w13, w2, *routes[0], 0, *scales)
    distinct = torch.unique(routes[0][1]).numel()
    weight_bytes = distinct * (w13[0].numel() + w2[0].numel()) * w13.element_size()
    must_move = weight_bytes + 2 * xs[0].numel() * xs[0].element_size()
    pairs = tokens * TOP_K
    row = {"T": tokens, "distinct_experts": distinct,
           "expected_distinct": round(EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens), 1),
           "bytes": must_move, "roofline_us": round(must_move / rate, 2),
           "rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
           "tiles": [asdict(tiles(pairs, EXPERTS, 2 * INTER, HIDDEN, fp8)),
                     asdict(tiles(pairs, EXPERTS, HIDDEN, INTER, fp8))],
           "triton_graph_us": round(time_graph(triton_moe, xs, routes), 2),
           "triton_eager_us": round(eager_us(triton_moe, list(zip(xs, routes))), 2),
           "torch_loop_us": round(eager_us(
               lambda x, r: fused_moe_ref(x, w13, w2, *r, 0, *scales), list(zip(xs, routes))), 2)}
    row["align_us"] = align_us(routes, row["tiles"][0]["block_m"])
    row["align_taken"] = "one_launch" if pairs <= ONE_LAUNCH_MAX_PAIRS else "torch"
    if sweep:
        timed = {}
        for entry in SWEEP:
            config = sweep_tiles(*entry, fp8)
            try:
                timed[str(entry)] = round(time_graph(
                    lambda x, r, config=config: triton_moe(x, r, config), xs, routes), 2)
            except triton.runtime.errors.OutOfResources:
                continue
        row["sweep_us"] = timed
        row["sweep_best"] = min(timed, key=timed.get)
    return row


def align_us(routes: list, block_m: int) -> dict:
    """Microseconds per call of each way to sort the pairs (graphed, CALLS routings)."""
    ids = [route[1] for route in routes]
    ways = {"torch": moe_align}
    if ids[0].shape[0] <= 512:
        ways["one_launch"] = moe_align_one_launch
    return {name: round(time_graph(lambda i, _, fn=fn: fn(i, EXPERTS, 0, block_m), ids, ids), 2)
            for name, fn in ways.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,128,256,1024,4096")
    ap.add_argument("--fp8", action="store_true", help="e4m3 experts with per-channel scales")
    ap.add_argument("--sweep", action="store_true", help="also time every SWEEP tile")
    args = ap.parse_args()
    torch.manual_seed(0)
    rate = copy_rate()
    weights = experts(args.fp8)
    res = {"device": torch.cuda.get_device_name(), "hidden": HIDDEN, "experts": EXPERTS,
           "top_k": TOP_K, "moe_intermediate": INTER,
           "weights": "fp8_e4m3" if args.fp8 else "bf16", "calls_per_graph": CALLS,
           "copy_TBps": round(rate / 1e6, 3), "rows": []}
    for tokens in map(int, args.tokens.split(",")):
        try:
            row = bench_tokens(tokens, weights, rate, args.fp8, args.sweep)
        except Exception as e:  # noqa: BLE001 - a size that fails (a capture, say) is reported
            res["rows"].append({"T": tokens, "error": repr(e)[:1000]})
            print(f"T={tokens:5d} failed: {e!r}"[:2000], file=sys.stderr, flush=True)
            continue
        res["rows"].append(row)
        print(f"T={tokens:5d} triton {row['triton_graph_us']:9.2f} us graphed "
              f"{row['triton_eager_us']:9.2f} eager | torch loop {row['torch_loop_us']:9.2f} "
              f"| roofline {row['roofline_us']:8.2f} us | rel err {row['rel_err']:.1e} "
              f"| align {row['align_us']}",
              file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
