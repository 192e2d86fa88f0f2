"""The serving benchmarks through the real HTTP endpoint: `sweep` (goodput against arrival
rate, per configuration) and `validate` (`pd-cluster tune`'s prediction against `pd-cluster
bench`, bench/harness/validate.py), with `rejudge` and `chart` for a sweep.json.
`python -m bench.serving_sweep` is the command line (its docstring has the GPU runs' commands).

Serving a configuration, and reading the engine actors' stamps, take a local Ray: that part
is a harness (`ServingHarness`, bench/serving_bench.py's LocalRayHarness) handed in by the
caller, so nothing here imports Ray.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bench.harness.serving_runs import (
    RECORD_COLUMNS, SHUTDOWN_S, Deployment, app_args, bench, compact, kv_capacity, kv_transfer,
    lifetime, point_stats, run_header, scrape, slo_of, wait_idle, warm_up, whole_run,
    write_json)
from bench.harness.validate import validate
from pd_cluster.config import EngineConfig
from pd_cluster.tuning.slo import SLO

if TYPE_CHECKING:
    from pd_cluster.config import EngineConfig

DESCRIPTION = ("Serving benchmarks through the real HTTP endpoint: `sweep` (goodput against "
               "arrival rate,\nper configuration) and `validate` (`pd-cluster tune`'s prediction "
               "against `pd-cluster bench`).")


class ServingHarness(Protocol):
    """What the benchmarks need of a place to serve in (bench/serving_bench.py)."""

    def serving(self, args: dict, opts: argparse.Namespace) -> AbstractContextManager[str]:
        """The URL of the application built from `args`, stopped on exit."""

    def engine_stages(self, since: float) -> dict | None:
        """Disaggregated: stage percentiles inside the first P and D since `since`."""

    def ttft_parts(self, report: dict, since: float, measured: slice) -> dict | None:
        """The measured requests' TTFT cut at the router's and P's own stamps."""

    def app_engine(self, args: dict) -> EngineConfig:
        """The engine configuration the application builds from `args`."""


SWEEP_DEFINITIONS = {
    "window": "each rate's load lasts settle_s + window_s + settle_s; the measured requests are "
              "those sent in the middle window_s, so they run under a steady load",
    "latencies": "mean and numpy p50/p90/p99 over the measured requests, as pd-cluster bench "
                 "defines them: TTFT to the first streamed text, TPOT (e2e - TTFT) / (tokens - 1)",
    "goodput": "slo_attainment (share of measured requests meeting both SLOs) x offered rate, "
               "as DistServe and `tune` count it; goodput_per_gpu divides by the GPUs; "
               "achieved_rate = measured requests / window_s",
    "slo_attained": "slo_attainment >= the SLO percentile",
    "kv_transfer": "deltas of the router's /metrics over the whole bench run: prefill replicas' "
                   "pd_kv_transfer_seconds and _bytes over pd_disagg_decisions{decision=remote}. "
                   "A prefill replica times a transfer from the end of the prompt's compute to "
                   "its last write landing (layer-wise writes before that overlap compute): the "
                   "transfer's part of TTFT. share_of_ttft = its mean / the run's mean TTFT",
    "engine_stages": "disaggregated only: percentiles of the actors' stages inside "
                     "the first P and D (queue+prefill, destination, transfer, handoff, landing) "
                     "over every request of the run, from the actors' own monotonic stamps",
    "summary": "per config: best goodput per GPU at a rate meeting the SLOs, and the rate where "
               "attainment crosses the percentile, interpolated between the last rate that "
               "met it and the next (None when the sweep did not cross it)",
    "whole_run": "pd-cluster bench's own report of every request of the run (its goodput "
                 "divides by first send to last completion: ramp-up and drain included)",
}


def measure(url: str, opts: argparse.Namespace, slo: SLO, rate: float, seed: int,
            settle: float) -> dict:
    """One rate: load for settle + window + settle seconds, the middle window measured."""
    span = 2 * settle + opts.window
    n = int(rate * span * 1.3) + 10           # more than the Poisson arrivals in `span`
    before, since = scrape(url), time.monotonic()
    report = bench(url, opts, ["--rate", f"{rate:g}", "--max-duration", f"{span:g}"], n, seed)
    after = scrape(url)
    inside = [r for r in report["records"] if settle <= r["start"] < settle + opts.window]
    return {**point_stats(inside, rate, opts.window, slo),
            "kv_transfer": kv_transfer(before, after, report["ttft"]["mean"]),
            "engine_stages": opts.harness.engine_stages(since),
            "whole_run": whole_run(report), "records": compact(inside)}


# -- sweep ----------------------------------------------------------------------------------------

def sweep(opts: argparse.Namespace) -> int:
    slo, base = slo_of(opts), app_args(opts.set, opts.config_path)
    life = lifetime(opts, slo)
    settle = life / 2 if opts.settle is None else opts.settle
    opts.timeout = opts.timeout or 2 * life + 5
    rates = [float(r) for r in opts.rates.split(",")]
    result = {**run_header(opts, base, slo), "rates": rates,
              "settings": {"settle_s": settle, "window_s": opts.window, "timeout_s": opts.timeout,
                           "rates_per_gpu": opts.per_gpu,
                           "stop_below": opts.stop_below, "budget_s": opts.budget_s,
                           "slo_lifetime_s": life},
              "definitions": SWEEP_DEFINITIONS, "configs": []}
    out = Path(opts.output_dir)
    deadline = time.monotonic() + opts.budget_s
    deployments = [Deployment.parse(c) for c in opts.configs.split(",")]
    for i, dep in enumerate(deployments):
        entry = {"config": str(dep), **dep.args(), "gpus": dep.gpus, "points": [], "skipped": []}
        result["configs"].append(entry)
        # Each configuration gets an even share of the time left.
        own = time.monotonic() + (deadline - time.monotonic()) / (len(deployments) - i)
        try:
            _sweep_config(dep, entry, {**base, **dep.args()}, opts, slo, rates,
                          (settle, life, own), lambda: write_sweep(result, out))
        except Exception as e:  # noqa: BLE001 - record it and go on with the next config
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"{dep}: {entry['error']}", file=sys.stderr)
        write_sweep(result, out)
    return 0 if all(c["points"] for c in result["configs"]) else 1


def _sweep_config(dep: Deployment, entry: dict, args: dict, opts: argparse.Namespace, slo: SLO,
                  rates: list[float], timing: tuple[float, float, float], save) -> None:
    settle, life, deadline = timing
    started = time.monotonic()
    with opts.harness.serving(args, opts) as url:
        entry["start_s"] = time.monotonic() - started
        block_size = (args.get("engine") or {}).get("block_size", EngineConfig().block_size)
        entry["kv_capacity_tokens"] = kv_capacity(url, int(block_size))
        warm_up(url, opts)
        stop, below = "", 0
        for k, rate in enumerate(rates):
            rate = rate * dep.gpus if opts.per_gpu else rate
            needed = 2 * settle + opts.window + life + 10 + SHUTDOWN_S
            stop = stop or ("time budget" if time.monotonic() + needed > deadline else "")
            if stop:
                entry["skipped"].append({"rate": rate, "why": stop})
                continue
            print(f"{dep}: rate {rate:g} req/s", flush=True)
            point = measure(url, opts, slo, rate, opts.seed + k + 1, settle)
            point["rate_per_gpu"] = rate / dep.gpus
            point["goodput_per_gpu"] = point["goodput"] / dep.gpus
            entry["points"].append(point)
            save()
            below = below + 1 if point["slo_attainment"] < opts.stop_below else 0
            if below == 2:
                stop = f"SLO attainment below {opts.stop_below:g} at two rates in a row"
            wait_idle(url)


def summary(configs: list[dict], percentile: float) -> dict:
    """Per configuration: the best goodput per GPU at a rate that met the SLOs, and the rate
    where the attainment crosses the percentile; disaggregated over colocated for each pair."""
    per = {}
    for c in configs:
        ok = [p for p in c["points"] if p["slo_attained"]]
        crossing = _crossing(c["points"], percentile / 100)
        per[c["config"]] = {
            "max_rate_meeting_slo": max((p["rate"] for p in ok), default=None),
            "goodput_per_gpu_meeting_slo": max((p["goodput_per_gpu"] for p in ok), default=0.0),
            # Its highest rate measured met the SLOs: the real limit is that or above.
            "lower_bound": bool(c["points"]) and c["points"][-1]["slo_attained"],
            "crossing_rate": crossing,
            "crossing_rate_per_gpu": None if crossing is None else crossing / c["gpus"]}
    ratios, by_name = {}, {c["config"]: c for c in configs}
    for d in (k for k in per if k.startswith("disagg")):
        for c in (k for k in per if k.startswith("colo")):
            a, b = per[d], per[c]
            ratio = a["goodput_per_gpu_meeting_slo"] / b["goodput_per_gpu_meeting_slo"] \
                if b["goodput_per_gpu_meeting_slo"] else None
            bound = RATIO_BOUND[a["lower_bound"], b["lower_bound"]]
            lowest = min((p["rate"] / by_name[c]["gpus"] for p in by_name[c]["points"]),
                         default=None)
            if ratio is None and lowest and a["goodput_per_gpu_meeting_slo"]:
                # Colocated met them at no rate measured: its limit is below the lowest one.
                ratio, bound = a["goodput_per_gpu_meeting_slo"] / lowest, \
                    "more than: colocated met the SLOs at no rate measured (its lowest used)"
            ratios[f"{d} / {c}"] = {
                "goodput_per_gpu_meeting_slo": ratio, "bound": bound,
                "crossing_rate_per_gpu": a["crossing_rate_per_gpu"] / b["crossing_rate_per_gpu"]
                if a["crossing_rate_per_gpu"] and b["crossing_rate_per_gpu"] else None}
    return {"configs": per, "disagg_over_colocated": ratios}


# What the goodput ratio is, by which side met the SLOs at its highest measured rate.
RATIO_BOUND = {(False, False): "exact", (True, False): "at least", (False, True): "at most",
               (True, True): "unknown: neither side reached its limit"}


def _crossing(points: list[dict], target: float) -> float | None:
    """Rate where the attainment falls below `target`, linear between the two rates around it."""
    for lo, hi in zip(points, points[1:]):
        if lo["slo_attainment"] >= target > hi["slo_attainment"]:
            t = (lo["slo_attainment"] - target) / (lo["slo_attainment"] - hi["slo_attainment"])
            return lo["rate"] + t * (hi["rate"] - lo["rate"])
    return None


def write_sweep(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summary(result["configs"], result["slo"]["percentile"])
    write_json(result, out / "sweep.json")
    chart(result, out / "sweep.png")


def chart(result: dict, path: Path) -> None:
    """Goodput per GPU, TTFT and TPOT at the SLO percentile against the offered rate per GPU."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no chart (run `chart` where it is installed)", file=sys.stderr)
        return
    matplotlib.use("Agg")           # files only: no display on servers
    import matplotlib.pyplot as plt

    q = f"p{result['slo']['percentile']:g}"
    q = q if q in ("p50", "p90", "p99") else "p90"
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), dpi=100)
    top = max((p["rate_per_gpu"] for c in result["configs"] for p in c["points"]), default=1)
    for c in result["configs"]:
        x = [p["rate_per_gpu"] for p in c["points"]]
        axes[0].plot(x, [p["goodput_per_gpu"] for p in c["points"]], "o-", label=c["config"])
        for ax, name in ((axes[1], "ttft"), (axes[2], "tpot")):
            ax.plot(x, [math.nan if p[name][q] is None else p[name][q] * 1e3
                        for p in c["points"]], "o-", label=c["config"])
    axes[0].plot([0, top], [0, top], ":", color="gray", label="all requests meet the SLOs")
    axes[1].axhline(result["slo"]["ttft"] * 1e3, color="red", linestyle="--", label="SLO")
    axes[2].axhline(result["slo"]["tpot"] * 1e3, color="red", linestyle="--", label="SLO")
    for ax, label in zip(axes, ("goodput per GPU (req/s)", f"TTFT {q} (ms)", f"TPOT {q} (ms)")):
        ax.set_xlabel("offered rate per GPU (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['workload']}; {result['slo_text']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def rejudge(opts: argparse.Namespace) -> int:
    """The same measured requests judged under other SLOs: each point's attainment, goodput
    and the summary again, from its per-request records (no new run)."""
    src = Path(opts.sweep_json)
    result = json.loads(src.read_text())
    slo = slo_of(opts)
    result["rejudged_from"] = {"file": src.name, "slo_text": result["slo_text"]}
    result["slo"] = {"ttft": slo.ttft, "tpot": slo.tpot, "percentile": slo.percentile}
    result["slo_text"] = str(slo)
    met_column = RECORD_COLUMNS.index("met_slo")
    for config in result["configs"]:
        for point in config["points"]:
            rows = [dict(zip(RECORD_COLUMNS, r)) for r in point["records"]]
            met = [bool(r["ok"]) and slo.met(r["ttft"], r["tpot"] or 0.0) for r in rows]
            for record, ok in zip(point["records"], met):
                record[met_column] = ok
            attainment = sum(met) / len(met) if met else 0.0
            point.update(slo_attainment=attainment, slo_attained=slo.attained(attainment),
                         goodput=attainment * point["rate"],
                         goodput_per_gpu=attainment * point["rate"] / config["gpus"])
    out = Path(opts.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["summary"] = summary(result["configs"], slo.percentile)
    write_json(result, out)
    chart(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"]["disagg_over_colocated"], indent=1))
    return 0


# -- the command line -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("sweep", "validate"):
        p = sub.add_parser(name)
        p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                       help="override an app arg of configs/pd.yaml, e.g. dtype=bfloat16")
        p.add_argument("--input-len", default="2048", help="length distribution, as in bench")
        p.add_argument("--output-len", default="256")
        p.add_argument("--ttft-slo", default="1s")
        p.add_argument("--tpot-slo", default="25ms")
        p.add_argument("--slo-percentile", default="p90")
        p.add_argument("--timeout", type=float, help="seconds per request (default: twice the "
                       "longest life of a request meeting the SLOs, + 5)")
        p.add_argument("--warmup-requests", type=int, default=8)
        p.add_argument("--num-cpus", type=float, help="Ray CPUs (default: detected)")
        p.add_argument("--num-gpus", type=float, help="Ray GPUs (default: detected)")
        p.add_argument("--start-timeout", type=float, default=600.0)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("-o", "--output-dir", required=True)
    s = sub.choices["sweep"]
    s.add_argument("--configs", default="disagg:1:1,colo:2", help="disagg:P:D or colo:N, ...")
    s.add_argument("--rates", required=True, help="requests/s, ascending, comma-separated")
    s.add_argument("--per-gpu", action="store_true", help="--rates are per GPU: each config "
                   "runs them times its GPU count (configs of different sizes, same load/GPU)")
    s.add_argument("--window", type=float, default=12.0, help="measured seconds per rate")
    s.add_argument("--settle", type=float, help="unmeasured seconds of load before and after "
                   "the window (default: half the longest life of a request meeting the SLOs)")
    s.add_argument("--stop-below", type=float, default=0.5, help="skip a config's higher "
                   "rates once its SLO attainment was below this at two rates in a row")
    s.add_argument("--budget-s", type=float, default=470.0, help="wall seconds for it all")
    s.set_defaults(func=sweep)
    v = sub.choices["validate"]
    v.add_argument("--profile", required=True, help="file written by `pd-cluster profile`")
    v.add_argument("--rates", required=True, help="requests/s, comma-separated")
    v.add_argument("--gpus", type=int, default=2, help="tune's GPU budget")
    v.add_argument("--kv-bandwidth", default="250GB/s", help="tune's (NIXL over NVLink: ~260)")
    v.add_argument("--kv-capacity-tokens", type=int, help="tune's (default: the profile's)")
    v.add_argument("--no-colocated", action="store_true", help="tune: P:D candidates only")
    # Queue-wait percentiles over a few hundred requests move by tens of percent from one
    # Poisson trace to the next (busy periods are long), so both sides measure many.
    v.add_argument("--tune-requests", type=int, default=3000, help="tune's measured requests")
    v.add_argument("--requests", type=int, default=600, help="bench's measured requests")
    v.add_argument("--tolerance", type=float, default=0.15)
    v.add_argument("--serving-overhead-lengths", metavar="N,N,...", help="first measure the "
                   "serving overhead (`pd-cluster profile-serving`) at these prompt lengths on "
                   "the recommended config, unless the profile has one; tune then uses it")
    v.add_argument("--serving-load-requests", type=int, default=400, help="requests of "
                   "profile-serving's load phase (its served step scales; default 400: 64 gave "
                   "x1.13 on the prefill steps at 12 req/s on two H100s, 400 gave x1.22)")
    v.add_argument("--serving-load-rate", type=float, help="arrivals/s of that load phase "
                   "(default: the highest rate validated on that config)")
    v.set_defaults(func=validate)
    r = sub.add_parser("rejudge", help="a sweep.json's requests judged under other SLOs")
    r.add_argument("sweep_json")
    r.add_argument("--ttft-slo", default="1s")
    r.add_argument("--tpot-slo", default="25ms")
    r.add_argument("--slo-percentile", default="p90")
    r.add_argument("-o", "--output", required=True, help="JSON to write (a PNG beside it)")
    r.set_defaults(func=rejudge)
    c = sub.add_parser("chart", help="redraw sweep.png beside a sweep.json")
    c.add_argument("sweep_json")
    c.set_defaults(func=lambda a: chart(json.loads(Path(a.sweep_json).read_text()),
                                        Path(a.sweep_json).with_suffix(".png")) or 0)
    return parser.parse_args(argv)


def run(argv: Sequence[str] | None, harness: ServingHarness | None,
        config_path: str | Path) -> int:
    """The command line: `sweep`, `validate`, `rejudge` or `chart`; `config_path` is the Serve
    config whose first application's args the served configurations start from. `rejudge`
    and `chart` serve nothing: they run without a harness."""
    opts = parse_args(None if argv is None else list(argv))
    opts.argv = sys.argv[1:] if argv is None else list(argv)
    opts.harness, opts.config_path = harness, Path(config_path)
    return opts.func(opts)
