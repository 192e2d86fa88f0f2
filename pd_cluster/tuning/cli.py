"""`pd-cluster profile`, `profile-serving` and `tune`: their arguments and what they print and
write."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pd_cluster.tuning.profile import Profile
from pd_cluster.tuning.search import Candidate
from pd_cluster.tuning.slo import SLO, parse_bandwidth, parse_rate
from pd_cluster.tuning.workload import Workload


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure prefill/decode step latency and fit models")
    p.add_argument("--model", default=None, help="model directory (default: bundled SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape (config.json only)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs of the engine measured (tune counts that many per instance)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the engine's KV cache dtype (fp8: half the KV bytes of 16-bit); the "
                   "profile records it, with its KV bytes per token and KV capacity")
    p.add_argument("-o", "--output", default="pd-profile.json", help="profile file to write")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on CPU, torch's choice on GPU)")
    p.add_argument("--prefill-tokens", type=_ints, help="Σ prompt tokens per step, e.g. 16,64,256")
    p.add_argument("--prefill-splits", type=_ints, help="prompts per step, e.g. 1,2,4")
    p.add_argument("--decode-batches", type=_ints, help="decode batch sizes, e.g. 1,4,16")
    p.add_argument("--decode-contexts", type=_ints, help="context lengths, e.g. 64,256,512")
    p.add_argument("--passes", type=int, help="measurements per point (median taken)")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per point and pass")
    p.add_argument("--held-out", type=float, default=0.2, help="share of points kept for checking")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from pd_cluster.config import EngineConfig
    from pd_cluster.tuning.measure import default_grid, run_profile

    grid = default_grid(EngineConfig(device=args.device).torch_device().type)
    for name in ("prefill_tokens", "prefill_splits", "decode_batches", "decode_contexts",
                 "passes", "decode_steps"):
        if getattr(args, name) is not None:
            setattr(grid, name, getattr(args, name))
    if not 0 <= args.held_out < 1:
        raise ValueError(f"--held-out: expected a share in [0, 1), got {args.held_out}")
    grid.held_out_fraction = args.held_out
    profile = run_profile(args.model, args.dtype, args.device, grid, args.threads,
                          progress=not args.quiet, load_format=args.load_format,
                          tensor_parallel_size=args.tensor_parallel_size,
                          kv_cache_dtype=args.kv_cache_dtype)
    profile.save(args.output)
    for name, m in (("prefill", profile.prefill), ("decode", profile.decode)):
        terms = " + ".join(f"{c:.4g}·{f}" for c, f in zip(m.coef, m.features))
        err = (f"held-back error mean {m.error.mean_abs_pct:.1f}%, max {m.error.max_abs_pct:.1f}% "
               f"({m.error.num_held_out} points)" if m.error else "no held-back points")
        print(f"{name}: seconds = {terms}; {err}")
    print(f"wrote {args.output}")
    return 0


def add_profile_serving(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile-serving", help="measure the serving overhead (TTFT beyond the "
                       "engine) through a running server and add it to a profile")
    p.add_argument("--profile", required=True, help="file written by `pd-cluster profile`")
    p.add_argument("--url", required=True, help="server URL, with or without /v1")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--lengths", type=_ints, default=(128, 512, 1024, 2048),
                   help="prompt lengths in tokens (default 128,512,1024,2048)")
    p.add_argument("--requests-per-length", type=int, default=5, help="median taken")
    p.add_argument("--load-requests", type=int, default=64, help="requests of the load "
                   "phase, whose engine steps (from the server's /metrics) give the served "
                   "step scales (0: skip; steps stay as profiled)")
    p.add_argument("--load-rate", type=float, help="arrivals per second of the load phase "
                   "(default: half of what the served prefill engines take, by the profile)")
    p.add_argument("--load-input-len", type=int, help="prompt tokens in the load phase "
                   "(default: the longest of --lengths)")
    p.add_argument("--load-output-len", type=int, default=128,
                   help="output tokens in the load phase (default 128)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the server's per-step token budget, to chunk prompts as it does")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("-o", "--output", help="profile file to write (default: --profile)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_profile_serving)


def _profile_serving(args: argparse.Namespace) -> int:
    import asyncio

    from pd_cluster.benchmark.cli import _first_model
    from pd_cluster.benchmark.client import Endpoint
    from pd_cluster.tuning.serving import measure_overhead

    profile = Profile.load(args.profile)
    for name in ("requests_per_length", "max_num_batched_tokens", "timeout", "load_output_len"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
    for name in ("load_rate", "load_input_len"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
    if args.load_requests < 0:
        raise ValueError("--load-requests: must be >= 0")
    lengths = tuple(sorted(set(args.lengths)))
    if len(lengths) < 2:
        raise ValueError("--lengths: need two lengths or more to fit a + b·tokens")
    base = args.url.rstrip("/")
    base = base if base.endswith("/v1") else f"{base}/v1"
    model = args.model or asyncio.run(_first_model(base, args.api_key))
    profile.serving_overhead = measure_overhead(
        profile, Endpoint(base, model, args.api_key), lengths, args.requests_per_length,
        args.max_num_batched_tokens, args.timeout, progress=not args.quiet,
        load_requests=args.load_requests, load_rate=args.load_rate,
        load_input_len=args.load_input_len, load_output_len=args.load_output_len)
    if load := profile.serving_overhead.load:
        print(f"load: {load['requests']} x {load['input_len']} -> {load['output_len']} tokens "
              f"at {load['rate']:.3g} req/s on {load['served']}")
        for kind in ("prefill", "decode"):
            k = load[kind]
            print(f"  {kind} steps: {k['steps']}, {k['seconds']:.3f} s served, "
                  f"{k['profiled_seconds']:.3f} s profiled: x{load[kind + '_scale']:.3g}")
        print(f"  mixed steps (not used): {load['mixed']['steps']}")
    for s in profile.serving_overhead.samples:
        print(f"{s['prompt_tokens']:6d} tokens: TTFT {1e3 * s['ttft_s']:8.1f} ms = engine "
              f"{1e3 * s['engine_s']:8.1f} ms + overhead {1e3 * s['overhead_s']:8.1f} ms")
    print(profile.serving_overhead.describe())
    output = args.output or args.profile
    profile.save(output)
    print(f"wrote {output}")
    return 0


def add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="simulate P:D counts and recommend one for your SLOs")
    p.add_argument("--profile", required=True, help="file written by `pd-cluster profile`")
    p.add_argument("--workload", help="lengths file: JSON(L) or CSV with input_len, output_len")
    p.add_argument("--input-len", help="input length distribution (default 512), e.g. "
                   "uniform:100:1024, normal:512:128, lognormal:400:0.8, exp:300")
    p.add_argument("--output-len", help="output length distribution (default 128)")
    p.add_argument("--rate", default="max", help="requests/s, or max: find each candidate's "
                   "highest rate that meets the SLOs (default)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--ttft-slo", default="1s", help="time to first token, e.g. 500ms")
    p.add_argument("--tpot-slo", default="100ms", help="time per output token, e.g. 50ms")
    p.add_argument("--slo-percentile", default="p90", help="share of requests that must meet both")
    p.add_argument("--gpus", type=int, default=8, help="GPU budget: (P + D, or engines) x the "
                   "profile's tensor_parallel_size at most")
    p.add_argument("--kv-bandwidth", default="25GB/s", help="KV transfer bandwidth into one "
                   "decode instance, e.g. 50GB/s, 400Gbps")
    p.add_argument("--kv-capacity-tokens", type=int,
                   help="KV tokens one instance holds (default: the profile's engine)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=500, help="measured requests per run")
    p.add_argument("--no-colocated", action="store_true", help="only disaggregated candidates")
    p.add_argument("--no-serving-overhead", action="store_true",
                   help="leave out the profile's measured serving overhead (engine time only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output-dir", default="pd-tune", help="folder for the table, chart, "
                   "config snippets and results.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--planner", action="store_true", help="replay a workload whose mix shifts "
                   "(--phase ...) with the P:D planner and with the best fixed tiers; needs "
                   "a numeric --rate")
    p.add_argument("--phase", nargs=3, action="append", metavar=("INPUT", "OUTPUT", "SECONDS"),
                   help="with --planner: one phase of the shifting workload (lengths as "
                   "--input-len / --output-len), repeated in order")
    p.add_argument("--interval", default="15s", help="with --planner: between decisions")
    p.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    from pd_cluster.tuning.report import (CHART_NEEDS, format_table, helm_values_snippet,
                                          serve_args_snippet, write_chart)
    from pd_cluster.tuning.search import SearchSettings, search
    from pd_cluster.tuning.simulator import EngineLimits

    profile = Profile.load(args.profile)
    if args.no_serving_overhead:
        profile.serving_overhead = None
    workload = Workload.from_args(args.workload, args.input_len, args.output_len)
    slo = SLO.parse(args.ttft_slo, args.tpot_slo, args.slo_percentile)
    for name in ("gpus", "max_num_batched_tokens", "max_num_seqs", "num_requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    if not args.burstiness > 0:
        raise ValueError("--burstiness: must be > 0")
    limits = EngineLimits(args.kv_capacity_tokens or int(profile.engine["kv_capacity_tokens"]),
                          parse_bandwidth(args.kv_bandwidth), args.max_num_batched_tokens,
                          args.max_num_seqs)
    settings = SearchSettings(args.gpus, parse_rate(args.rate), args.num_requests,
                              args.burstiness, include_colocated=not args.no_colocated,
                              seed=args.seed,
                              gpus_per_instance=profile.tensor_parallel_size)
    if profile.serving_overhead:
        print(profile.serving_overhead.describe())
    if args.planner:
        return _tune_planner(args, profile, limits, slo, settings)
    results = search(profile, limits, workload, slo, settings, progress=not args.quiet)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(results, slo, settings.rate is None)
    best = results[0]
    title = f"{profile.model.get('name')} on {_device(profile)}\n{workload.source}; {slo}"
    charted = write_chart(results, out / "goodput_per_gpu.png", title)
    snippets = {"pd-args.yaml": serve_args_snippet(best, limits, profile.kv_cache_dtype),
                "helm-values.yaml": helm_values_snippet(best, limits)}
    for name, text in snippets.items():
        (out / name).write_text(text)
    (out / "table.txt").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(
        {"slo": asdict(slo), "workload": workload.source, "rate": args.rate,
         "limits": asdict(limits), "profile": str(args.profile),
         "serving_overhead": _overhead_row(profile),
         "results": [_row(c) for c in results]}, indent=1) + "\n")
    print(f"{title}\n\n{table}\n")
    if best.goodput <= 0:
        print("no candidate meets the SLOs: loosen them, lower the rate or add GPUs",
              file=sys.stderr)
        return 1
    print(f"recommended: {best.spec} ({best.goodput_per_gpu:.3g} req/s per GPU)\n")
    print("\n".join(snippets.values()))
    chart = "goodput_per_gpu.png, " if charted else ""
    print(f"wrote {out}/: table.txt, {chart}pd-args.yaml, helm-values.yaml, results.json")
    if not charted:
        print(CHART_NEEDS, file=sys.stderr)
    return 0


def _tune_planner(args: argparse.Namespace, profile: Profile, limits: Any, slo: SLO,
                  settings: Any) -> int:
    """`tune --planner`: the shifting workload replayed with the planner, against every fixed
    P:D of the budget; prints both goodputs per GPU, writes planner.json."""
    from pd_cluster.planner import PlannerSettings
    from pd_cluster.tuning.replay import Phase, replay
    from pd_cluster.tuning.search import candidates
    from pd_cluster.tuning.slo import parse_duration

    if settings.rate is None or not args.phase:
        raise ValueError("--planner: needs --rate R (requests/s) and at least one "
                         "--phase INPUT OUTPUT SECONDS")
    phases = [Phase(Workload.from_args(None, i, o), parse_duration(s, "--phase seconds"))
              for i, o, s in args.phase]
    interval = parse_duration(args.interval, "--interval")
    gpi = settings.gpus_per_instance
    fixed = [replay(profile, limits, slo, phases, settings.rate, spec, interval, None,
                    settings.burstiness, settings.seed)
             for spec in tqdm(candidates(settings.gpu_budget, False, gpi), desc="fixed tiers",
                              disable=args.quiet)]
    best = max(fixed, key=lambda r: r.goodput_per_gpu)
    # The planner starts from the best fixed tiers: what it gains is its own doing.
    planned = replay(profile, limits, slo, phases, settings.rate, best.start, interval,
                     PlannerSettings(slo.ttft, slo.tpot, settings.gpu_budget,
                                     cooldown_s=interval, gpus_per_instance=gpi),
                     settings.burstiness, settings.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner.json").write_text(json.dumps(
        {"slo": asdict(slo), "rate": settings.rate, "phases": args.phase,
         "interval_s": interval, "best_fixed": best.summary(),
         "planner": planned.summary()}, indent=1) + "\n")
    for row in planned.intervals:
        print(f"{row['start_s']:7.0f} s  {row['tiers']:>10}  met {row['met']:4d}/"
              f"{row['requests']:<4d} {row['action']:>15}  {row['reason']}")
    print(f"\ngoodput per GPU: planner {planned.goodput_per_gpu:.3g} req/s "
          f"({planned.met}/{planned.requests} met, {planned.summary()['mean_gpus']:.2f} GPUs "
          f"on average); best fixed tiers {best.start}: "
          f"{best.goodput_per_gpu:.3g} req/s ({best.met}/{best.requests} met)")
    print(f"wrote {out}/planner.json")
    return 0


def _overhead_row(profile: Profile) -> dict | None:
    """What results.json records of the overhead the simulation added (None: none)."""
    o = profile.serving_overhead
    return {"coef": o.coef, "prefill_scale": o.prefill_scale, "decode_scale": o.decode_scale,
            "url": o.url, "date": o.date} if o else None


def _device(profile: Profile) -> str:
    return profile.machine.get("gpu") or profile.machine.get("cpu") or "?"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None      # JSON has no Infinity


def _row(c: Candidate) -> dict:
    return {"config": str(c.spec), "num_prefill": c.spec.num_prefill,
            "num_decode": c.spec.num_decode, "gpus": c.spec.num_gpus,
            "tensor_parallel_size": c.spec.gpus_per_instance, "rate": c.rate,
            "goodput": c.goodput, "goodput_per_gpu": c.goodput_per_gpu,
            "attainment": c.attainment, "ttft": _finite(c.ttft), "tpot": _finite(c.tpot)}
