"""Measuring a served configuration for the serving benchmarks (`python -m bench.serving_sweep`,
bench/serving_bench.py): the app's args with overrides, its /metrics scraped, `pd-cluster
bench` run at a rate and its per-request records reduced. No Ray here: serving the app on a
local Ray is bench/serving_bench.py's part."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from pd_cluster.benchmark.client import RequestRecord
from pd_cluster.benchmark.metrics import summarize
from pd_cluster.cli import main as pd_cluster
from pd_cluster.tuning.slo import SLO
from pd_cluster.tuning.workload import Workload

RECORD_COLUMNS = ("index", "start", "ok", "prompt_tokens", "output_tokens", "ttft", "tpot",
                  "e2e", "met_slo")
SHUTDOWN_S = 20.0           # stopping Serve and Ray, and the GPUs' memory coming back


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


def app_args(overrides: list[str], config_path: str | Path) -> dict:
    """A Serve config's (configs/pd.yaml's) first application's `args` with KEY=YAML
    overrides (dotted keys reach nested ones)."""
    return set_args(yaml.safe_load(Path(config_path).read_text())["applications"][0]["args"],
                    overrides)


def set_args(args: dict, overrides: list[str]) -> dict:
    """`args` with KEY=YAML overrides, e.g. engine.dtype=bfloat16 (dotted keys reach nested
    ones), and without api_key_env: a bench talks to its own app, without a key."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = args
        for name in parents:      # a scalar on the way ("auto" resources) becomes a mapping
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
        node[leaf] = yaml.safe_load(value)
    args.pop("api_key_env", None)
    return args


def get_text(url: str, timeout: float = 30.0) -> str | None:
    """The body of a 200 answer to GET `url`; None for any other answer or no answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode() if resp.status == 200 else None
    except OSError:
        return None


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The router's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(3):
        text = get_text(f"{url}/metrics")
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


# -- one load run and its numbers -----------------------------------------------------------------

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


def whole_run(report: dict) -> dict:
    return {k: report[k] for k in ("requests", "completed", "failed", "duration_s",
                                   "request_throughput", "output_token_throughput", "goodput",
                                   "slo_attainment")}


def slo_of(opts: argparse.Namespace) -> SLO:
    return SLO.parse(opts.ttft_slo, opts.tpot_slo, opts.slo_percentile)


def quantile_name(slo: SLO) -> str:
    return f"p{slo.percentile:g}"


def lifetime(opts: argparse.Namespace, slo: SLO) -> float:
    """Longest life of a request that meets both SLOs: TTFT SLO + (longest output - 1) x TPOT."""
    lengths = Workload.from_args(None, opts.input_len, opts.output_len).sample(
        1000, np.random.default_rng(opts.seed))
    return slo.ttft + (max(o for _, o in lengths) - 1) * slo.tpot


def run_header(opts: argparse.Namespace, args: dict, slo: SLO) -> dict:
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


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")
