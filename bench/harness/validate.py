"""`validate`: `pd-cluster tune`'s recommendation at a rate against `pd-cluster bench` at that
rate, served through a harness (bench/harness/sweep.py; the commands are in
bench/serving_sweep.py)."""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.diagnostics import pcts, replay
from bench.harness.serving_runs import (
    Deployment, app_args, bench, compact, kv_capacity, lifetime, point_stats, quantile_name,
    run_header, slo_of, wait_idle, warm_up, whole_run, write_json)
from pd_cluster.cli import main as pd_cluster
from pd_cluster.tuning.slo import SLO
from pd_cluster.tuning.workload import Workload

VALIDATE_DEFINITIONS = {
    "percentiles": "numpy percentiles over the measured requests, in the simulator and here",
    "tpot": "both: (last token - first token) / (output tokens - 1)",
    "ttft": "simulator: arrival to the end of the prefill step of the last prompt chunk, plus "
            "the profile's serving overhead when it has one (predicted.serving_overhead, "
            "measured by `pd-cluster profile-serving`: the router, HTTP, tokenization and the "
            "first token's way to the client); it leaves out the KV transfer, which bench's "
            "TTFT (send to first text) holds",
    "tpot_difference": "the simulator's first token is at the end of prefill, so its TPOT holds "
                       "the KV transfer and the wait to join the decode batch, which bench's "
                       "TTFT holds instead",
    "goodput": "both: SLO attainment of the measured requests x offered rate, 0 when the "
               "attainment is below the SLO percentile (`tune --rate`); bench's own goodput "
               "(met / first send to last completion) is in measured.whole_run",
    "warm_up": "both: ceil(rate x L) requests before and after the measured ones, L = TTFT SLO "
               "+ (longest output - 1) x TPOT SLO; the measured ones are the middle slice",
    "step_times": "simulator: the profile's fitted in-process engine steps; served steps also "
                  "pay the engine actors', Ray's and the router's per-token work (diagnosis)",
}


def validate(opts: argparse.Namespace) -> int:
    from pd_cluster.tuning.profile import Profile

    profile = Profile.load(opts.profile)
    slo, base = slo_of(opts), app_args(opts.set, opts.config_path)
    opts.timeout = opts.timeout or 2 * lifetime(opts, slo) + 5
    engine = opts.harness.app_engine(base)
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {**run_header(opts, base, slo), "profile": Path(opts.profile).name,
              "tolerance": opts.tolerance, "definitions": VALIDATE_DEFINITIONS, "points": []}
    plans = predict_all(opts, engine, out)
    todo = list(plans.items())
    while todo:                                     # each recommended config started once
        dep, predictions = todo.pop(0)
        try:
            with opts.harness.serving({**base, **dep.args()}, opts) as url:
                capacity = kv_capacity(url, engine.block_size)
                warm_up(url, opts)
                if opts.serving_overhead_lengths and profile.serving_overhead is None:
                    # Measured on the first recommended config, then tune runs again with it:
                    # the recommendation may move, and this server measures only what stays.
                    # Its load phase at the rate being validated: served steps slow down with
                    # the arrivals that land during them, so the scales are load-dependent.
                    load_rate = opts.serving_load_rate or max(p["rate"] for _, p in predictions)
                    profile = add_serving_overhead(opts, profile, url, engine, out, load_rate)
                    result["profile"] = Path(opts.profile).name
                    plans = predict_all(opts, engine, out)
                    predictions = plans.pop(dep, [])
                    todo = list(plans.items())
                for seed, predicted in predictions:
                    print(f"{dep}: rate {predicted['rate']:g} req/s", flush=True)
                    measured, report = measure_like_tune(url, opts, slo, predicted["rate"],
                                                         seed)
                    # The same model on bench's own arrivals: what is left is the model's.
                    window = slice(measured["warm_up_requests"],
                                   measured["warm_up_requests"] + opts.requests)
                    replayed = replay(profile, predicted["limits"], dep.num_prefill,
                                      dep.num_decode, report, window, predicted["rate"], slo)
                    result["points"].append({**compare(predicted, measured, opts.tolerance,
                                                       slo, profile),
                                             "on_measured_arrivals": compare_replay(
                                                 replayed, measured, opts.tolerance, slo),
                                             "config": str(dep), "rate": predicted["rate"],
                                             "served_kv_capacity_tokens": capacity})
                    write_json(result, out / "validate.json")
                    wait_idle(url)
        except Exception as e:  # noqa: BLE001 - record it and go on with the next config
            result.setdefault("errors", []).append(f"{dep}: {type(e).__name__}: {e}")
            print(result["errors"][-1], file=sys.stderr)
        write_json(result, out / "validate.json")
    return 0 if result["points"] and all(p["pass"] for p in result["points"]) else 1


def predict_all(opts: argparse.Namespace, engine, out: Path) -> dict:
    """tune at every rate, grouped by the configuration it recommends."""
    plans: dict[Deployment, list[tuple[int, dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, rate in enumerate(float(r) for r in opts.rates.split(",")):
            predicted = predict(opts, engine, rate, Path(tmp) / f"r{rate:g}")
            # A seed per rate: the same prompts again would be served from the prefix cache.
            plans.setdefault(Deployment.parse(predicted["config"]), []).append(
                (opts.seed + k + 1, predicted))
            shutil.copy(Path(tmp) / f"r{rate:g}" / "goodput_per_gpu.png",
                        out / "tune_goodput_per_gpu.png")
    return plans


def add_serving_overhead(opts: argparse.Namespace, profile, url: str, engine, out: Path,
                         load_rate: float):
    """`pd-cluster profile-serving` against `url`; opts.profile becomes the copy it writes."""
    copy = out / f"{Path(opts.profile).stem}_serving.json"
    # Its load phase at the workload's lengths when they are fixed ones.
    load = [f"--load-{side}-len={n}" for side, n in (("input", opts.input_len),
                                                      ("output", opts.output_len))
            if str(n).isdigit()]
    if pd_cluster(["profile-serving", "--profile", opts.profile, "--url", url,
                   "--lengths", opts.serving_overhead_lengths, *load,
                   "--load-requests", str(opts.serving_load_requests),
                   "--load-rate", f"{load_rate:g}",
                   "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
                   "--timeout", str(opts.timeout), "-o", str(copy), "--quiet"]) != 0:
        raise RuntimeError("pd-cluster profile-serving failed (its error is above)")
    opts.profile = str(copy)
    return type(profile).load(copy)


def predict(opts: argparse.Namespace, engine, rate: float, out: Path) -> dict:
    """`pd-cluster tune` at `rate`: its recommendation and, from a second run over the same
    simulated requests judged at p50, that configuration's medians."""
    def tune(percentile: str, where: Path) -> dict:
        extra = ["--kv-capacity-tokens", str(opts.kv_capacity_tokens)] \
            if opts.kv_capacity_tokens else []
        extra += ["--no-colocated"] if opts.no_colocated else []
        pd_cluster(["tune", "--profile", opts.profile, "--input-len", opts.input_len,
                    "--output-len", opts.output_len, "--rate", f"{rate:g}",
                    "--ttft-slo", opts.ttft_slo, "--tpot-slo", opts.tpot_slo,
                    "--slo-percentile", percentile, "--gpus", str(opts.gpus),
                    "--kv-bandwidth", opts.kv_bandwidth,
                    "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
                    "--max-num-seqs", str(engine.max_num_seqs),
                    "--num-requests", str(opts.tune_requests), "--seed", str(opts.seed),
                    "-o", str(where), "--quiet", *extra])
        if not (where / "results.json").exists():
            raise RuntimeError(f"pd-cluster tune wrote no results in {where}")
        return json.loads((where / "results.json").read_text())

    main = tune(opts.slo_percentile, out)
    best = main["results"][0]
    median = next(r for r in tune("p50", out / "p50")["results"] if r["config"] == best["config"])
    q = quantile_name(slo_of(opts))
    return {"config": str(Deployment(best["num_prefill"], best["num_decode"])),
            "tune_config": best["config"], "rate": rate,
            "ttft_p50": median["ttft"], f"ttft_{q}": best["ttft"],
            "tpot_p50": median["tpot"], f"tpot_{q}": best["tpot"],
            "slo_attainment": best["attainment"], "goodput": best["goodput"],
            "goodput_per_gpu": best["goodput_per_gpu"], "limits": main["limits"],
            "serving_overhead": main["serving_overhead"],
            "tune_table": (out / "table.txt").read_text(), "tune_results": main["results"]}


def measure_like_tune(url: str, opts: argparse.Namespace, slo: SLO, rate: float,
                      seed: int) -> tuple[dict, dict]:
    """Bench at `rate` with tune's warm-up and cool-down: numbers of the middle slice (with
    where their TTFT went inside the server), and bench's whole report."""
    probe = Workload.from_args(None, opts.input_len, opts.output_len).sample(
        opts.tune_requests, np.random.default_rng(opts.seed))      # tune's first draw
    pad = math.ceil(rate * (slo.ttft + (max(o for _, o in probe) - 1) * slo.tpot))
    since = time.monotonic()
    report = bench(url, opts, ["--rate", f"{rate:g}"], opts.requests + 2 * pad, seed)
    inside = report["records"][pad:pad + opts.requests]
    point = point_stats(inside, rate, max(inside[-1]["start"] - inside[0]["start"], 1e-9), slo)
    ok = [r for r in inside if r["ok"]]
    for name, values in (("ttft", [r["ttft"] for r in ok]),
                         ("tpot", [r["tpot"] for r in ok if r["output_tokens"] > 1])):
        for q in (50, slo.percentile):
            point[f"{name}_p{q:g}"] = float(np.percentile(values, q)) if values else None
    mean = (lambda xs: float(np.mean(xs)) if xs else 0.0)  # noqa: E731
    return {**point, "goodput": point["goodput"] if point["slo_attained"] else 0.0,
            "warm_up_requests": pad, "mean_decode_s": mean([r["e2e"] - r["ttft"] for r in ok]),
            "mean_prompt_tokens": mean([r["prompt_tokens"] or r["input_len"] for r in ok]),
            "mean_output_tokens": mean([r["output_tokens"] for r in ok]),
            "whole_run": whole_run(report), "records": compact(inside),
            # TTFT less the engine's share the server reported: what tune's overhead models.
            "serving_path_ms": pcts(1e3 * np.array([r["ttft"] - r["engine_ttft"] for r in ok
                                                    if r.get("engine_ttft") is not None]))
            or None,
            "ttft_parts": opts.harness.ttft_parts(report, since,
                                                  slice(pad, pad + opts.requests))}, report


def compare_replay(replayed: dict, measured: dict, tolerance: float, slo: SLO) -> dict:
    """Relative errors of the simulator on bench's own arrivals (`replay`)."""
    checks = compare({**replayed, "config": "", "rate": 0.0}, measured, tolerance, slo,
                     None, diagnosis=False)
    return {"pass": checks["pass"], "checks": checks["checks"], "predicted": replayed}


def compare(predicted: dict, measured: dict, tolerance: float, slo: SLO, profile,
            diagnosis: bool = True) -> dict:
    """Relative errors (measured - predicted) / predicted; pass when all are within tolerance."""
    checks = {}
    for name in ("ttft_p50", f"ttft_{quantile_name(slo)}", "tpot_p50", f"tpot_{quantile_name(slo)}", "goodput"):
        p, m = predicted[name], measured[name]
        err = None if p is None or m is None else \
            (m - p) / p if p else (0.0 if m == 0 else math.inf)
        checks[name] = {"predicted": p, "measured": m,
                        "relative_error": None if err is None or math.isinf(err) else err,
                        "within": err is not None and abs(err) <= tolerance}
    out = {"pass": all(c["within"] for c in checks.values()), "checks": checks,
           "slo_attainment": {"predicted": predicted["slo_attainment"],
                              "measured": measured["slo_attainment"]}}
    if diagnosis:
        out.update(diagnosis=diagnose(predicted, measured, profile), predicted=predicted,
                   measured=measured)
    return out


def diagnose(predicted: dict, measured: dict, profile) -> dict:
    """The served decode step against the profile's, at the batch Little's law gives."""
    dep = Deployment.parse(predicted["config"])
    batch = predicted["rate"] * measured["mean_decode_s"] / dep.num_decode
    ctx = measured["mean_prompt_tokens"] + measured["mean_output_tokens"] / 2
    whole = max(1, round(batch))
    prompt = measured["mean_prompt_tokens"]
    return {"decode_batch_per_instance": batch, "mean_context": ctx,
            "profile_decode_step_s": profile.decode_time(whole, whole * ctx),
            "served_decode_step_s": measured["mean_decode_s"]
            / max(1.0, measured["mean_output_tokens"] - 1),
            "profile_prefill_one_prompt_s": profile.prefill_time(prompt, prompt ** 2),
            "how": "batch = rate x mean (e2e - TTFT) / decode instances; profile step = "
                   "decode_time(batch, batch x (prompt + output / 2)); served step = mean "
                   "(e2e - TTFT) / (output - 1)"}
