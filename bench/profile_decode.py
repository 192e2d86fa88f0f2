"""Where a decode step's time goes on GPU: wall time vs GPU kernel time, and top kernels.

    python -m bench.profile_decode [--batch 64[,128,...]] [--context 1024] [--quantization fp8]
        [--kv-cache-dtype fp8]

Prints JSON: per-step wall ms, per-step CUDA kernel ms (sum of kernel durations), the host
time spent in `engine.step()`, and the ten kernels with the most time. With async scheduling
(the default) the host's work for step k+1 overlaps step k on the device.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.models import dummy_model_dir
from pd_cluster import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64", help="comma-separated batch sizes, one engine")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sync", action="store_true", help="async_scheduling off")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--gc-off", action="store_true",
                    help="Python's garbage collector off once the engine is built")
    args = ap.parse_args()
    llm = LLM(dummy_model_dir(), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=16384, max_model_len=4096,
              async_scheduling=not args.sync, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    if args.gc_off:
        gc.disable()
    results = [profile_batch(llm.engine, int(b), args.context, args.steps)
               for b in args.batch.split(",")]
    print(json.dumps(results[0] if len(results) == 1 else results, indent=1))


def profile_batch(engine, batch: int, context: int, steps: int) -> dict:
    rng = random.Random(batch)
    # Room for every token until the profiled steps end: no request finishes before then.
    params = SamplingParams(temperature=0, max_tokens=4000 - context, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(1000, 120000) for _ in range(context)], params)
           for _ in range(batch)]
    while any(r.num_computed_tokens < context for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    host = 0.0
    # CUDA activity only: recording every host op would slow the host enough to open gaps.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            a = time.perf_counter()
            engine.step()
            host += time.perf_counter() - a
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    running = len(engine.scheduler.running)
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernel_us = sum(e.self_device_time_total for e in events) / steps
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:14]
    return {
        "batch": batch, "running": running,
        "context": context, "wall_ms": wall * 1e3,
        "gpu_kernel_ms": kernel_us / 1e3, "step_call_ms": host / steps * 1e3,
        "async_scheduling": engine.async_scheduling,
        "top_kernels": [{"name": e.key[:80], "ms_per_step": e.self_device_time_total
                         / steps / 1e3, "calls_per_step": e.count / steps}
                        for e in top],
        "idle": idle_gaps(prof, steps)}


def idle_gaps(prof, steps: int) -> dict:
    """Where the GPU sat idle between kernels: short gaps (kernel to kernel inside a graph)
    against long ones (waiting for the host), per step, with the longest gaps' neighbours."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    gaps = []
    for a, b in zip(kernels, kernels[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 0:
            gaps.append((gap, a.name[:50], b.name[:50]))
    short = [g for g, _, _ in gaps if g < 5]
    long = sorted((g for g in gaps if g[0] >= 5), reverse=True)
    pairs: dict[str, float] = {}
    for g, a, b in long:
        pairs[f"{a} -> {b}"] = pairs.get(f"{a} -> {b}", 0.0) + g
    return {"kernels_per_step": len(kernels) / steps,
            "short_gaps_ms_per_step": sum(short) / steps / 1e3,
            "short_gaps_per_step": len(short) / steps,
            "long_gaps_ms_per_step": sum(g for g, _, _ in long) / steps / 1e3,
            "longest_gaps_ms": [round(g / 1e3, 3) for g, _, _ in long[:8]],
            "long_gap_pairs_ms_per_step": {k: v / steps / 1e3 for k, v in
                                           sorted(pairs.items(), key=lambda kv: -kv[1])[:12]}}


if __name__ == "__main__":
    main()
