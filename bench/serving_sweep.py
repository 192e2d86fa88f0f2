"""Serving benchmarks through the real HTTP endpoint: `sweep` (goodput against arrival rate,
per configuration) and `validate` (`pd-cluster tune`'s prediction against `pd-cluster bench`).

On nvidia-h200-x2, carrying .devbundle and .gpucarry/tok, every run starts with

    bash .devbundle/unpack.sh && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 && \
      xz -dkf .gpucarry/tok/tokenizer.json.xz && \
      M=$(python3 bench/models.py --tokenizer-from .gpucarry/tok) && \
      S="--set model=$M --set load_format=dummy --set dtype=bfloat16 --set max_model_len=4096"

and goes on with one of these (about 8 minutes each):

    # 1. prompt-heavy sweep, 1P1D and two colocated engines
    python3 bench/serving_sweep.py sweep $S --configs disagg:1:1,colo:2 --rates 4,8,12,16,20 \
      --input-len 2048 --output-len 256 -o $OUT/prompt_heavy 2>&1 | tee $OUT/prompt_heavy.log
    # 2. balanced sweep
    python3 bench/serving_sweep.py sweep $S --configs disagg:1:1,colo:2 --rates 3,6,9,12 \
      --input-len 512 --output-len 512 -o $OUT/balanced 2>&1 | tee $OUT/balanced.log
    # 3. tune's recommendation for 2 GPUs at rate R, measured at R (PROFILE from
    #    `python3 -m pd_cluster.cli profile --model $M --dtype bfloat16 -o PROFILE`, one GPU)
    python3 bench/serving_sweep.py validate $S --profile PROFILE --rates R --gpus 2 \
      --input-len 2048 --output-len 256 -o $OUT/validate 2>&1 | tee $OUT/validate.log

SLOs default to issue 9's: TTFT and TPOT p90 within 1 s and 25 ms. A configuration is
`disagg:P:D` or `colo:N`. Each is served once per command: its own local Ray,
`serve.run(build_app(args))` on a loopback port, args = configs/pd.yaml's with `--set`
overrides; a few unmeasured requests warm it up; then `pd-cluster bench` runs at each rate,
with the router's /metrics scraped around it. The JSON is rewritten after every rate, so a
run cut short keeps what it measured; `--budget-s` (default 470 s) skips rates that would
not fit, and a configuration's higher rates are skipped once its SLO attainment was below
`--stop-below` at two rates in a row. `chart` redraws sweep.png from a sweep.json.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pd_cluster.benchmark.client import RequestRecord  # noqa: E402
from pd_cluster.benchmark.metrics import summarize  # noqa: E402
from pd_cluster.cli import main as pd_cluster  # noqa: E402
from pd_cluster.tuning.slo import SLO  # noqa: E402
from pd_cluster.tuning.workload import Workload  # noqa: E402

RECORD_COLUMNS = ("index", "start", "ok", "prompt_tokens", "output_tokens", "ttft", "tpot",
                  "e2e", "met_slo")
SHUTDOWN_S = 20.0           # stopping Serve and Ray, and the GPUs' memory coming back
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
    "summary": "per config: best goodput per GPU at a rate meeting the SLOs, and the rate where "
               "attainment crosses the percentile, interpolated between the last rate that "
               "met it and the next (None when the sweep did not cross it)",
    "whole_run": "pd-cluster bench's own report of every request of the run (its goodput "
                 "divides by first send to last completion: ramp-up and drain included)",
}
VALIDATE_DEFINITIONS = {
    "percentiles": "numpy percentiles over the measured requests, in the simulator and here",
    "tpot": "both: (last token - first token) / (output tokens - 1)",
    "ttft": "simulator: arrival to the end of the prefill step of the last prompt chunk; it "
            "leaves out the KV transfer, the router (HTTP, tokenization, routing) and the "
            "first token's way to the client, which bench's TTFT (send to first text) holds",
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


@dataclass(frozen=True, slots=True)
class Deployment:
    """A configuration under test: P prefill + D decode replicas, or D colocated engines."""

    num_prefill: int
    num_decode: int

    @classmethod
    def parse(cls, text: str) -> Deployment:
        kind, *counts = text.strip().split(":")
        if kind == "disagg" and len(counts) == 2:
            return cls(int(counts[0]), int(counts[1]))
        if kind == "colo" and len(counts) == 1:
            return cls(0, int(counts[0]))
        raise ValueError(f"configuration {text!r}: expected disagg:P:D or colo:N")

    @property
    def gpus(self) -> int:
        return self.num_prefill + self.num_decode

    def args(self) -> dict:
        mode = "colocated" if self.num_prefill == 0 else "disaggregated"
        return {"mode": mode, "num_prefill": self.num_prefill, "num_decode": self.num_decode}

    def __str__(self) -> str:
        return f"colo:{self.num_decode}" if self.num_prefill == 0 else \
            f"disagg:{self.num_prefill}:{self.num_decode}"


def app_args(overrides: list[str]) -> dict:
    """configs/pd.yaml's `args` with KEY=YAML overrides (dotted keys reach nested ones)."""
    args = yaml.safe_load((ROOT / "configs" / "pd.yaml").read_text())["applications"][0]["args"]
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = args
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(value)
    args.pop("api_key_env", None)          # the bench talks to its own app, without a key
    return args


# -- serving one configuration ----------------------------------------------------------------

def _get(url: str, timeout: float = 30.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode() if resp.status == 200 else None
    except OSError:
        return None


@contextlib.contextmanager
def serving(args: dict, opts: argparse.Namespace) -> Iterator[str]:
    """URL of the application built from `args` on a private local Ray; stopped afterwards."""
    import ray
    from ray import serve

    from router.app import build_app

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)          # the engines inherit them through Ray
    work = Path(tempfile.mkdtemp(prefix="pdsw", dir="/tmp"))     # short: Ray's socket paths
    ray.init(address="local", num_cpus=opts.num_cpus, num_gpus=opts.num_gpus,
             include_dashboard=False, namespace="serve", log_to_driver=False,
             _temp_dir=str(work))
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(build_app(args), name="pd", route_prefix="/")],
                       wait_for_applications_running=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + opts.start_timeout
        while _get(f"{url}/health", timeout=5) is None:
            app = serve.status().applications.get("pd")
            if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the application failed to start: {app.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy application after {opts.start_timeout} s")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        _wait_gpus_free()


def _wait_gpus_free(timeout: float = 60.0) -> None:
    """Until the engines' processes have given their GPU memory back (when nvidia-smi exists)."""
    deadline = time.monotonic() + timeout
    while shutil.which("nvidia-smi") and time.monotonic() < deadline:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True).stdout.split()
        if all(float(v) < 2048 for v in used):
            return
        time.sleep(1)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The router's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(3):
        text = _get(f"{url}/metrics")
        if text is not None:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples}
    raise RuntimeError(f"{url}/metrics did not answer")


def metric_sum(metrics: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all((k, want) in ls for k, want in labels.items()))


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until no engine runs or queues a request (aborted stragglers of the last run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(url)
        if not metric_sum(m, "pd_num_requests_running") + metric_sum(m, "pd_num_requests_waiting"):
            return
        time.sleep(0.5)


def kv_capacity(url: str, block_size: int) -> dict[str, int]:
    """KV tokens each engine replica holds ("prefill0", "decode0", ...), from /metrics."""
    m = scrape(url)
    return {f"{dict(ls)['role']}{dict(ls)['replica']}":
            int((used + m.get(("pd_kv_blocks_free", ls), 0.0)) * block_size)
            for (name, ls), used in m.items() if name == "pd_kv_blocks_used"}


# -- one load run and its numbers -------------------------------------------------------------

def bench(url: str, opts: argparse.Namespace, load: list[str], n: int, seed: int) -> dict:
    """`pd-cluster bench` with `load` (e.g. --rate 4); its JSON report, records included.
    Seeds differ between runs: the same seed sends the same prompts, which the prefix cache
    would then serve."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        rc = pd_cluster(["bench", "--base-url", url, "-n", str(n), *load,
                         "--input-len", opts.input_len, "--output-len", opts.output_len,
                         "--ttft-slo", opts.ttft_slo, "--tpot-slo", opts.tpot_slo,
                         "--slo-percentile", opts.slo_percentile, "--timeout", f"{opts.timeout:g}",
                         "--seed", str(seed), "--quiet", "-o", str(path)])
        if not path.exists():
            raise RuntimeError(f"pd-cluster bench failed (exit {rc})")
        return json.loads(path.read_text())


def warm_up(url: str, opts: argparse.Namespace) -> None:
    """First requests pay for kernel compilation and connection set-up: run them unmeasured."""
    if opts.warmup_requests:
        bench(url, opts, ["--concurrency", str(max(1, opts.warmup_requests // 2))],
              opts.warmup_requests, seed=99991)


def point_stats(records: list[dict], rate: float, span: float, slo: SLO) -> dict:
    """Latencies, throughput over `span` seconds, SLO attainment and goodput of `records`."""
    report = summarize([RequestRecord(**r) for r in records], span, slo)
    attainment = report["slo_attainment"]
    return {"rate": rate, "measured": len(records), "achieved_rate": len(records) / span,
            **{k: report[k] for k in ("completed", "failed", "errors", "ttft", "tpot", "itl",
                                      "e2e", "request_throughput", "output_token_throughput",
                                      "slo_attainment")},
            "slo_attained": bool(records) and slo.attained(attainment),
            "goodput": attainment * rate}


def kv_transfer(before: dict, after: dict, mean_ttft: float | None) -> dict:
    """The KV transfer's part of TTFT over one bench run, from /metrics deltas."""
    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    transfers = delta("pd_disagg_decisions_total", decision="remote")
    if not transfers:
        return {"transfers": 0, "seconds_per_request": None, "bytes_per_request": None,
                "share_of_ttft": None}
    per = delta("pd_kv_transfer_seconds_total", role="prefill") / transfers
    return {"transfers": int(transfers), "seconds_per_request": per,
            "bytes_per_request": delta("pd_kv_transfer_bytes_total", role="prefill") / transfers,
            "share_of_ttft": per / mean_ttft if mean_ttft else None}


def compact(records: list[dict]) -> list[list]:
    """Per-request rows in RECORD_COLUMNS order (ITL lists left out), times rounded to 1 µs."""
    return [[round(v, 6) if isinstance(v, float) else v for v in (r[c] for c in RECORD_COLUMNS)]
            for r in records]


def _whole_run(report: dict) -> dict:
    return {k: report[k] for k in ("requests", "completed", "failed", "duration_s",
                                   "request_throughput", "output_token_throughput", "goodput",
                                   "slo_attainment")}


def measure(url: str, opts: argparse.Namespace, slo: SLO, rate: float, seed: int,
            settle: float) -> dict:
    """One rate: load for settle + window + settle seconds, the middle window measured."""
    span = 2 * settle + opts.window
    n = int(rate * span * 1.3) + 10           # more than the Poisson arrivals in `span`
    before = scrape(url)
    report = bench(url, opts, ["--rate", f"{rate:g}", "--max-duration", f"{span:g}"], n, seed)
    after = scrape(url)
    inside = [r for r in report["records"] if settle <= r["start"] < settle + opts.window]
    return {**point_stats(inside, rate, opts.window, slo),
            "kv_transfer": kv_transfer(before, after, report["ttft"]["mean"]),
            "whole_run": _whole_run(report), "records": compact(inside)}


# -- sweep ------------------------------------------------------------------------------------

def sweep(opts: argparse.Namespace) -> int:
    slo, base = _slo(opts), app_args(opts.set)
    life = lifetime(opts, slo)
    settle = life / 2 if opts.settle is None else opts.settle
    opts.timeout = opts.timeout or 2 * life + 5
    rates = [float(r) for r in opts.rates.split(",")]
    result = {**_header(opts, base, slo), "rates": rates,
              "settings": {"settle_s": settle, "window_s": opts.window, "timeout_s": opts.timeout,
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
                          (settle, life, own), lambda: _write_sweep(result, out))
        except Exception as e:  # noqa: BLE001 - record it and go on with the next config
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"{dep}: {entry['error']}", file=sys.stderr)
        _write_sweep(result, out)
    return 0 if all(c["points"] for c in result["configs"]) else 1


def _sweep_config(dep: Deployment, entry: dict, args: dict, opts: argparse.Namespace, slo: SLO,
                  rates: list[float], timing: tuple[float, float, float], save) -> None:
    settle, life, deadline = timing
    started = time.monotonic()
    with serving(args, opts) as url:
        entry["start_s"] = time.monotonic() - started
        entry["kv_capacity_tokens"] = kv_capacity(url, int(args.get("block_size", 16)))
        warm_up(url, opts)
        stop, below = "", 0
        for k, rate in enumerate(rates):
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
            "crossing_rate": crossing,
            "crossing_rate_per_gpu": None if crossing is None else crossing / c["gpus"]}
    ratios = {}
    for d in (k for k in per if k.startswith("disagg")):
        for c in (k for k in per if k.startswith("colo")):
            a, b = per[d], per[c]
            ratios[f"{d} / {c}"] = {
                "goodput_per_gpu_meeting_slo": a["goodput_per_gpu_meeting_slo"]
                / b["goodput_per_gpu_meeting_slo"] if b["goodput_per_gpu_meeting_slo"] else None,
                "crossing_rate_per_gpu": a["crossing_rate_per_gpu"] / b["crossing_rate_per_gpu"]
                if a["crossing_rate_per_gpu"] and b["crossing_rate_per_gpu"] else None}
    return {"configs": per, "disagg_over_colocated": ratios}


def _crossing(points: list[dict], target: float) -> float | None:
    """Rate where the attainment falls below `target`, linear between the two rates around it."""
    for lo, hi in zip(points, points[1:]):
        if lo["slo_attainment"] >= target > hi["slo_attainment"]:
            t = (lo["slo_attainment"] - target) / (lo["slo_attainment"] - hi["slo_attainment"])
            return lo["rate"] + t * (hi["rate"] - lo["rate"])
    return None


def _write_sweep(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summary(result["configs"], result["slo"]["percentile"])
    _write_json(result, out / "sweep.json")
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


# -- validate ---------------------------------------------------------------------------------

def validate(opts: argparse.Namespace) -> int:
    from pd_cluster.tuning.profile import Profile
    from router.app_config import AppConfig

    profile = Profile.load(opts.profile)
    slo, base = _slo(opts), app_args(opts.set)
    opts.timeout = opts.timeout or 2 * lifetime(opts, slo) + 5
    engine = AppConfig.from_args(base)
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {**_header(opts, base, slo), "profile": Path(opts.profile).name,
              "tolerance": opts.tolerance, "definitions": VALIDATE_DEFINITIONS, "points": []}
    plans: dict[Deployment, list[tuple[int, dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, rate in enumerate(float(r) for r in opts.rates.split(",")):
            predicted = predict(opts, engine, rate, Path(tmp) / f"r{rate:g}")
            # A seed per rate: the same prompts again would be served from the prefix cache.
            plans.setdefault(Deployment.parse(predicted["config"]), []).append(
                (opts.seed + k + 1, predicted))
            if not (out / "tune_goodput_per_gpu.png").exists():
                shutil.copy(Path(tmp) / f"r{rate:g}" / "goodput_per_gpu.png",
                            out / "tune_goodput_per_gpu.png")
    for dep, predictions in plans.items():          # each recommended config started once
        try:
            with serving({**base, **dep.args()}, opts) as url:
                capacity = kv_capacity(url, engine.block_size)
                warm_up(url, opts)
                for seed, predicted in predictions:
                    print(f"{dep}: rate {predicted['rate']:g} req/s", flush=True)
                    measured = measure_like_tune(url, opts, slo, predicted["rate"], seed)
                    result["points"].append({**compare(predicted, measured, opts.tolerance,
                                                               slo, profile),
                                             "config": str(dep), "rate": predicted["rate"],
                                             "served_kv_capacity_tokens": capacity})
                    _write_json(result, out / "validate.json")
                    wait_idle(url)
        except Exception as e:  # noqa: BLE001 - record it and go on with the next config
            result.setdefault("errors", []).append(f"{dep}: {type(e).__name__}: {e}")
            print(result["errors"][-1], file=sys.stderr)
        _write_json(result, out / "validate.json")
    return 0 if result["points"] and all(p["pass"] for p in result["points"]) else 1


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
    q = _q(_slo(opts))
    return {"config": str(Deployment(best["num_prefill"], best["num_decode"])),
            "tune_config": best["config"], "rate": rate,
            "ttft_p50": median["ttft"], f"ttft_{q}": best["ttft"],
            "tpot_p50": median["tpot"], f"tpot_{q}": best["tpot"],
            "slo_attainment": best["attainment"], "goodput": best["goodput"],
            "goodput_per_gpu": best["goodput_per_gpu"], "limits": main["limits"],
            "tune_table": (out / "table.txt").read_text(), "tune_results": main["results"]}


def measure_like_tune(url: str, opts: argparse.Namespace, slo: SLO, rate: float,
                      seed: int) -> dict:
    """Bench at `rate` with tune's warm-up and cool-down; numbers of the middle slice."""
    probe = Workload.from_args(None, opts.input_len, opts.output_len).sample(
        opts.tune_requests, np.random.default_rng(opts.seed))      # tune's first draw
    pad = math.ceil(rate * (slo.ttft + (max(o for _, o in probe) - 1) * slo.tpot))
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
            "whole_run": _whole_run(report), "records": compact(inside)}


def compare(predicted: dict, measured: dict, tolerance: float, slo: SLO, profile) -> dict:
    """Relative errors (measured - predicted) / predicted; pass when all are within tolerance."""
    checks = {}
    for name in ("ttft_p50", f"ttft_{_q(slo)}", "tpot_p50", f"tpot_{_q(slo)}", "goodput"):
        p, m = predicted[name], measured[name]
        err = None if p is None or m is None else \
            (m - p) / p if p else (0.0 if m == 0 else math.inf)
        checks[name] = {"predicted": p, "measured": m,
                        "relative_error": None if err is None or math.isinf(err) else err,
                        "within": err is not None and abs(err) <= tolerance}
    return {"pass": all(c["within"] for c in checks.values()), "checks": checks,
            "slo_attainment": {"predicted": predicted["slo_attainment"],
                               "measured": measured["slo_attainment"]},
            "diagnosis": diagnose(predicted, measured, profile),
            "predicted": predicted, "measured": measured}


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


# -- shared -----------------------------------------------------------------------------------

def _slo(opts: argparse.Namespace) -> SLO:
    return SLO.parse(opts.ttft_slo, opts.tpot_slo, opts.slo_percentile)


def _q(slo: SLO) -> str:
    return f"p{slo.percentile:g}"


def lifetime(opts: argparse.Namespace, slo: SLO) -> float:
    """Longest life of a request that meets both SLOs: TTFT SLO + (longest output - 1) x TPOT."""
    lengths = Workload.from_args(None, opts.input_len, opts.output_len).sample(
        1000, np.random.default_rng(opts.seed))
    return slo.ttft + (max(o for _, o in lengths) - 1) * slo.tpot


def _header(opts: argparse.Namespace, args: dict, slo: SLO) -> dict:
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.splitlines() \
        if shutil.which("nvidia-smi") else []
    # The output folder by its name alone: no path of the machine it ran on.
    argv = [Path(a).name if a == opts.output_dir else a for a in opts.argv]
    return {"command": " ".join(["python3", "bench/serving_sweep.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"gpus": gpus, "cpus": os.cpu_count(), "python": platform.python_version()},
            "workload": Workload.from_args(None, opts.input_len, opts.output_len).source,
            "slo": {"ttft": slo.ttft, "tpot": slo.tpot, "percentile": slo.percentile},
            "slo_text": str(slo), "app_args": args}


def _write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    v.add_argument("--tune-requests", type=int, default=500, help="tune's measured requests")
    v.add_argument("--requests", type=int, default=200, help="bench's measured requests")
    v.add_argument("--tolerance", type=float, default=0.15)
    v.set_defaults(func=validate)
    c = sub.add_parser("chart", help="redraw sweep.png beside a sweep.json")
    c.add_argument("sweep_json")
    c.set_defaults(func=lambda a: chart(json.loads(Path(a.sweep_json).read_text()),
                                        Path(a.sweep_json).with_suffix(".png")) or 0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    opts.argv = sys.argv[1:] if argv is None else list(argv)
    return opts.func(opts)


if __name__ == "__main__":
    sys.exit(main())
