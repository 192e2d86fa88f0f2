"""`pd-cluster bench` against the real `serve run configs/pd.yaml` on the CPU: a dozen
streamed requests at 4/s; every metric is reported, and the goodput equals the SLO-meeting
records over the duration, recomputed from the per-request records of the JSON report.

`pd-cluster profile-serving` against the same server: the profile gains a serving overhead
section (served step scales from the server's step counters under a short Poisson load, one
median per prompt length), and tune's predicted TTFT moves up by that overhead.

The server is the session's shared default application (`default_server` in conftest.py:
a private local Ray on a free loopback port), which requires API_KEY.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
from pd_cluster.cli import main  # noqa: E402
from pd_cluster.tuning.profile import (DECODE_FEATURES, PREFILL_FEATURES,  # noqa: E402
                                       LatencyModel, Profile, ServingOverhead)
from pd_cluster.tuning.serving import MIN_STEPS, SCALE_RANGE, engine_seconds  # noqa: E402
from tests.support.serve_run import API_KEY  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@pytest.fixture(scope="module")
def server(default_server: str) -> str:
    """The session's shared default application (conftest.py), API_KEY required."""
    return default_server


def test_bench_reports_every_metric_and_goodput_matches_its_records(server: str,
                                                                     tmp_path: Path):
    report_path = tmp_path / "bench.json"
    before = time.monotonic()
    assert main(["bench", "--base-url", server, "--api-key", API_KEY, "-n", "12",
                 "--rate", "4", "--input-len", "32", "--output-len", "16", "--ttft-slo", "5s",
                 "--tpot-slo", "500ms", "--timeout", "120", "--quiet",
                 "-o", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["requests"] == report["completed"] == 12 and report["failed"] == 0
    for name in LATENCIES:
        assert set(report[name]) == {"mean", "p50", "p90", "p99"}
        assert all(v is not None and v >= 0 for v in report[name].values()), name
        assert report[name]["p50"] <= report[name]["p90"] <= report[name]["p99"]
    for name in ("request_throughput", "input_token_throughput", "output_token_throughput",
                 "goodput", "duration_s"):
        assert report[name] > 0, name
    records = report["records"]
    assert len(records) == 12
    assert all(r["output_tokens"] == 16 for r in records)      # ignore_eos honoured
    assert all(20 <= r["prompt_tokens"] <= 48 for r in records)
    slo = report["slo"]
    met = [r for r in records if r["ok"] and r["ttft"] <= slo["ttft"] and r["tpot"] <= slo["tpot"]]
    assert [r["met_slo"] for r in records] == [r in met for r in records]
    assert report["goodput"] == pytest.approx(len(met) / report["duration_s"])
    assert report["output_token_throughput"] == pytest.approx(
        sum(r["output_tokens"] for r in records) / report["duration_s"])
    first = min(r["start"] for r in records)
    last = max(r["start"] + r["e2e"] for r in records)
    assert report["duration_s"] == pytest.approx(last - first)
    for r in records:
        assert r["ttft"] <= r["e2e"] and len(r["itl"]) >= 1
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1))
    # Each record names the server's response id, and its send is on the host's monotonic
    # clock (origin + start), so server-side stamps can be joined with it.
    assert len({r["response_id"] for r in records}) == 12 and all(r["response_id"] for r in records)
    # The server names the engine's share of each TTFT (arrival in P to the first token).
    assert all(0 < r["engine_ttft"] < r["ttft"] for r in records)
    origin = report["records_clock_origin"]
    assert before <= origin + first and origin + last <= time.monotonic()


def test_concurrency_mode_and_a_tight_slo_lower_goodput(server: str, tmp_path: Path):
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--base-url", server, "--api-key", API_KEY, "-n", "6",
                 "--concurrency", "3", "--input-len", "uniform:16:48", "--output-len", "8",
                 "--ttft-slo", "1us", "--quiet", "-o", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["completed"] == 6
    assert report["slo_attainment"] == 0 and report["goodput"] == 0


def test_profile_serving_measures_an_overhead_that_tune_adds_to_ttft(server: str,
                                                                     tmp_path: Path):
    # A synthetic CPU-like profile (the engine's own, measured one takes a minute to make):
    # 0.2 ms per prompt token and 20 ms per step.
    engine_only = tmp_path / "cpu.json"
    Profile(machine={"cpu": "synthetic", "device": "cpu"},
            model={"name": "SmolLM2-135M-Instruct", "kv_bytes_per_token": 46080},
            date="2026-11-22T00:00:00+00:00",
            engine={"block_size": 16, "kv_capacity_tokens": 100_000},
            prefill=LatencyModel(PREFILL_FEATURES, [2e-4, 1e-8, 0.02]),
            decode=LatencyModel(DECODE_FEATURES, [1e-7, 1e-3, 0.02])).save(engine_only)
    measured = tmp_path / "cpu_served.json"
    assert main(["profile-serving", "--profile", str(engine_only), "--url", server,
                 "--api-key", API_KEY, "--lengths", "16,48", "--requests-per-length", "2",
                 "--load-requests", "20", "--load-rate", "4", "--load-output-len", "4",
                 "--timeout", "120", "--quiet", "-o", str(measured)]) == 0
    assert Profile.load(engine_only).serving_overhead is None     # -o: the input is kept
    overhead = Profile.load(measured).serving_overhead
    assert isinstance(overhead, ServingOverhead) and overhead.url == f"{server}/v1"
    # The load: twenty 48-word prompts at 4/s on the served shape (from /metrics); P's prefill
    # steps and D's decode steps counted by the server, each with its work and seconds.
    load = overhead.load
    assert load["served"] == "1P1D" and load["requests"] == 20 and load["input_len"] == 48
    for kind, scale in (("prefill", overhead.prefill_scale), ("decode", overhead.decode_scale)):
        k = load[kind]
        assert k["steps"] >= 1 and k["seconds"] > 0 and k["profiled_seconds"] > 0, load
        assert scale == load[f"{kind}_scale"]
        if k["steps"] >= MIN_STEPS:
            assert scale == pytest.approx(min(max(k["seconds"] / k["profiled_seconds"],
                                                  SCALE_RANGE[0]), SCALE_RANGE[1]))
        else:
            assert scale == 1.0
    assert load["prefill"]["sum_tokens"] >= 20 * 48     # words: at least a token each
    assert load["decode"]["batch"] >= 20 * 2            # 4 tokens: the last 3 decoded on D
    # The serving path under that load, per request TTFT less the engine's share the server
    # reported: 21 quantiles, from 0 up.
    path = overhead.under_load
    assert len(path) == 21 and path == sorted(path) and path[0] >= 0
    assert load["serving_path_ms"]["p50"] == pytest.approx(1e3 * path[10], abs=0.01)
    assert [s["prompt_tokens"] for s in overhead.samples] == [
        pytest.approx(16, abs=8), pytest.approx(48, abs=16)]
    for s in overhead.samples:      # the synthetic profile is not this CPU: no sign asserted
        assert s["ttft_s"] > 0 and s["engine_s"] > 0
        assert s["overhead_s"] == pytest.approx(s["ttft_s"] - s["engine_s"])
    # Non-negative least squares: where the scaled steps already cover a lone TTFT (a CPU
    # shared by Ray, Serve and the engine can scale steps under load past lone prompts) it is 0.
    assert all(c >= 0 for c in overhead.coef)
    for s in overhead.samples:      # the lone prompt's engine time is on the scaled steps
        assert s["engine_s"] == pytest.approx(engine_seconds(
            Profile.load(engine_only), s["prompt_tokens"], 2048, overhead.prefill_scale))

    def ttft(profile: Path) -> float:
        out = tmp_path / f"tune_{profile.stem}"
        assert main(["tune", "--profile", str(profile), "--rate", "0.2", "--input-len", "32",
                     "--output-len", "16", "--gpus", "1", "--ttft-slo", "60s",
                     "--tpot-slo", "60s", "--num-requests", "100", "--quiet", "-o", str(out)]) == 0
        return json.loads((out / "results.json").read_text())["results"][0]["ttft"]

    # The same scaled steps with and without an overhead: TTFT moves by exactly the overhead.
    with_overhead, scaled_only = tmp_path / "with_overhead.json", tmp_path / "scaled_only.json"
    profile = Profile.load(measured)
    profile.serving_overhead.under_load = None          # the lone-request fit alone
    for path, coef in ((with_overhead, [0.03, 1e-4]), (scaled_only, [0.0, 0.0])):
        profile.serving_overhead.coef = coef
        profile.save(path)
    added = Profile.load(with_overhead).serving_overhead.seconds(32)
    assert added == pytest.approx(0.03 + 32e-4)
    assert ttft(with_overhead) == pytest.approx(ttft(scaled_only) + added)
    # Measured under load, it takes the place of a: here a flat 50 ms, and b per token from
    # the load phase's prompts (48-word ones) to tune's 32-token ones.
    under_load = tmp_path / "under_load.json"
    profile.serving_overhead.under_load = [0.05] * 21
    profile.serving_overhead.coef = [0.03, 1e-4]
    profile.save(under_load)
    added = 0.05 + 1e-4 * (32 - load["prompt_tokens"])
    assert Profile.load(under_load).serving_overhead.seconds(32, 0.9) == pytest.approx(added)
    assert ttft(under_load) == pytest.approx(ttft(scaled_only) + added)
