"""`pd-cluster tune` on a synthetic H100-like profile (Llama-3.1-8B in bf16 on one H100):
prompt-heavy work gets more prefill than decode instances, output-heavy work the reverse,
a trickle of requests one colocated engine; the chart is a PNG that matplotlib reads back.
A measured serving overhead moves every predicted TTFT by itself and leaves TPOT alone; old
profile files, without one, still load.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO
from pd_cluster.cli import main
from pd_cluster.tuning.profile import (DECODE_FEATURES, PREFILL_FEATURES, LatencyModel,
                                       Profile, ServingOverhead, kv_bytes_per_token)
from pd_cluster.step_totals import StepWork, new_totals
from pd_cluster.tuning.serving import MIN_STEPS, engine_seconds, served_scales
from router.app_config import AppConfig

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def h100_profile(tmp_path_factory) -> Path:
    """Prefill: ~40 µs per token (16 GFLOP/token at ~400 TFLOP/s), 1 ns per token² of
    attention, 8 ms fixed; decode: 7 ms to read the weights, 50 µs per sequence, 44 ns per
    context token (131 KB of KV per token at ~3 TB/s)."""
    path = tmp_path_factory.mktemp("profile") / "h100.json"
    Profile(machine={"gpu": "NVIDIA H100 80GB HBM3 (synthetic)", "device": "cuda"},
            model={"name": "Llama-3.1-8B", "dtype": "bfloat16",
                   "kv_bytes_per_token": kv_bytes_per_token(32, 8, 128, 2)},
            date="2026-01-01T00:00:00+00:00",
            engine={"block_size": 16, "kv_capacity_tokens": 400_000},
            prefill=LatencyModel(PREFILL_FEATURES, [4e-5, 1e-9, 8e-3]),
            decode=LatencyModel(DECODE_FEATURES, [4.4e-8, 5e-5, 7e-3])).save(path)
    return path


def tune(profile: Path, out: Path, *args: str) -> list[dict]:
    assert main(["tune", "--profile", str(profile), "-o", str(out), "--quiet",
                 "--num-requests", "300", *args]) == 0
    return json.loads((out / "results.json").read_text())["results"]


@pytest.mark.slow
def test_prompt_heavy_with_loose_tpot_gets_more_prefill(h100_profile: Path, tmp_path: Path):
    # 25 ms TPOT is loose for a decode instance (10 ms steps) but not for a colocated engine,
    # whose steps with a 2048-token prefill chunk take ~90 ms.
    best = tune(h100_profile, tmp_path, "--input-len", "2048", "--output-len", "64",
                "--ttft-slo", "500ms", "--tpot-slo", "25ms", "--gpus", "5")[0]
    assert best["num_prefill"] > best["num_decode"] >= 1, best
    args = (tmp_path / "pd-args.yaml").read_text()
    assert "mode: disaggregated" in args and f"num_prefill: {best['num_prefill']}" in args
    config = AppConfig.from_args(yaml.safe_load(args))      # keys of the app's config tree
    assert config.num_prefill == best["num_prefill"] and config.engine.max_num_seqs >= 1
    helm = (tmp_path / "helm-values.yaml").read_text()
    assert f"prefill:\n  replicas: {best['num_prefill']}" in helm


@pytest.mark.slow
def test_output_heavy_gets_more_decode(h100_profile: Path, tmp_path: Path):
    # Among disaggregated deployments. With outputs 4x the prompts, colocated engines win
    # under this profile (prefill is a small share of their steps), so they are left out.
    results = tune(h100_profile, tmp_path, "--input-len", "uniform:128:384",
                   "--output-len", "uniform:768:1280", "--ttft-slo", "1s",
                   "--tpot-slo", "20ms", "--gpus", "4", "--no-colocated")
    best = results[0]
    assert best["num_decode"] > best["num_prefill"] >= 1, best
    assert all(r["num_prefill"] >= 1 for r in results)


@pytest.mark.slow
def test_tiny_load_gets_one_colocated_engine_and_a_png_chart(h100_profile: Path,
                                                               tmp_path: Path):
    results = tune(h100_profile, tmp_path, "--rate", "0.2", "--input-len", "512",
                   "--output-len", "128", "--gpus", "4")
    assert (results[0]["num_prefill"], results[0]["num_decode"]) == (0, 1), results[0]
    assert results[0]["attainment"] == 1.0
    chart = tmp_path / "goodput_per_gpu.png"
    assert chart.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image
    height, width, _ = matplotlib.image.imread(chart).shape
    assert (width, height) == (800, 450)
    assert "mode: colocated\nnum_prefill: 0\nnum_decode: 1" in \
        (tmp_path / "pd-args.yaml").read_text()
    assert "prefill:" not in (tmp_path / "helm-values.yaml").read_text()
    assert "colocated x1" in (tmp_path / "table.txt").read_text()


@pytest.mark.slow
def test_without_matplotlib_tune_writes_all_but_the_chart_and_names_the_extra(
        h100_profile: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import fails, as uninstalled
    results = tune(h100_profile, tmp_path, "--rate", "0.2", "--input-len", "512",
                   "--output-len", "128", "--gpus", "4")
    assert (results[0]["num_prefill"], results[0]["num_decode"]) == (0, 1)
    assert {p.name for p in tmp_path.iterdir()} == {"table.txt", "pd-args.yaml",
                                                    "helm-values.yaml", "results.json"}
    assert "pip install 'pd-cluster[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--ttft-slo", "fast"], "TTFT SLO: cannot read 'fast'"),
    (["--slo-percentile", "p150"], "percentile"),
    (["--input-len", "uniform:9"], "input length"),
    (["--workload", "/nonexistent/lengths.jsonl"], "workload file not found"),
    (["--kv-bandwidth", "fast"], "KV bandwidth"),
    (["--rate", "-3"], "rate"),
])
def test_bad_inputs_get_clear_errors(h100_profile: Path, tmp_path: Path, capsys, args,
                                     message):
    assert main(["tune", "--profile", str(h100_profile), "-o", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_profile_is_a_clear_error(tmp_path: Path, capsys):
    assert main(["tune", "--profile", str(tmp_path / "none.json")]) == 2
    assert "profile file not found" in capsys.readouterr().err


def test_workload_file_of_lengths(h100_profile: Path, tmp_path: Path):
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text("".join(json.dumps({"input_len": 300 + i, "output_len": 100})
                               + "\n" for i in range(20)))
    results = tune(h100_profile, tmp_path / "out", "--workload", str(lengths), "--rate", "2",
                   "--gpus", "2")
    assert {r["config"] for r in results} == {"1P1D", "colocated x1", "colocated x2"}


def overhead_of(samples: list[tuple[int, float]]) -> ServingOverhead:
    return ServingOverhead.fit([{"prompt_tokens": n, "ttft_s": 0.0, "engine_s": 0.0,
                                 "overhead_s": s} for n, s in samples],
                               "http://test", "2026-11-22", 2048)


def test_serving_overhead_fit_is_a_line_with_nonnegative_coefficients():
    line = overhead_of([(n, 0.03 + 4e-6 * n) for n in (128, 512, 1024, 2048)])
    assert line.coef == pytest.approx([0.03, 4e-6])
    assert line.seconds(1000) == pytest.approx(0.034)
    # Falling with length: the slope is pinned to 0 and the intercept is the mean.
    falling = overhead_of([(128, 0.05), (2048, 0.03)])
    assert falling.coef == pytest.approx([0.04, 0.0])
    # A line through a negative intercept: the intercept is pinned to 0, the slope refit.
    steep = overhead_of([(1000, 0.01), (2000, 0.03)])
    assert steep.coef[0] == 0.0 and steep.coef[1] == pytest.approx(70 / 5e6)  # Σxy / Σx²


def test_engine_time_of_a_lone_prompt_is_the_simulators_chunked_prefill(h100_profile: Path):
    profile = Profile.load(h100_profile)
    assert engine_seconds(profile, 512, 2048) == pytest.approx(profile.prefill_time(512, 512**2))
    # 3000 tokens under a 2048 budget: a full chunk, then 952 tokens attending to all 3000.
    assert engine_seconds(profile, 3000, 2048) == pytest.approx(
        profile.prefill_time(2048, 2048**2) + profile.prefill_time(952, 3000**2 - 2048**2))


def totals_of(steps: list[tuple[StepWork, float]]) -> dict[str, dict[str, float]]:
    """What a server's /metrics sums up (read_step_totals) after these steps."""
    totals = new_totals()
    for work, seconds in steps:
        totals[work.kind.value].add(work, seconds)
    return {kind: t.as_dict() for kind, t in totals.items()}


def test_step_scales_are_served_over_profiled_seconds_of_each_kind(h100_profile: Path):
    # A server whose prefill steps take 1.3x the profiled ones and decode steps 0.9x, and
    # whose mixed steps (not used) take any time.
    profile = Profile.load(h100_profile)
    chunks = [StepWork(sum_tokens=c, sum_sq_tokens=c * (2 * p + c)) for c, p in
              [(2048, 0), (1, 2048), (2048, 0), (512, 2048), (700, 0)] * 4]
    decodes = [StepWork(sum_ctx=b * ctx, batch=b) for b, ctx in [(1, 300), (8, 2100), (40, 900)]]
    mixed = [StepWork(sum_tokens=100, sum_sq_tokens=10_000, sum_ctx=500, batch=2)]
    before = totals_of([(w, 5.0) for w in chunks[:3] + decodes])
    after = totals_of([(w, 5.0) for w in chunks[:3] + decodes]
                      + [(w, 1.3 * profile.prefill.predict(
                          (w.sum_tokens, w.sum_sq_tokens, 1.0))) for w in chunks]
                      + [(w, 0.9 * profile.decode.predict((w.sum_ctx, w.batch, 1.0)))
                         for w in decodes * 4] + [(w, 9.0) for w in mixed])
    scales = served_scales(profile, before, after)
    assert scales["prefill_scale"] == pytest.approx(1.3)
    assert scales["decode_scale"] == pytest.approx(0.9)
    assert scales["prefill"]["steps"] == 20 and scales["decode"]["steps"] == 12
    assert scales["mixed"] == {"steps": 1, "seconds": 9.0}
    # Too few steps of a kind to say: it stays as profiled.
    few = served_scales(profile, before, after, min_steps=13)
    assert few["prefill_scale"] == pytest.approx(1.3) and few["decode_scale"] == 1.0
    assert MIN_STEPS <= 12


def test_prefill_scale_multiplies_every_simulated_prefill_step(h100_profile: Path):
    profile = Profile.load(h100_profile)
    bare = profile.prefill_time(2048, 2048**2)
    profile.serving_overhead = dataclasses.replace(overhead_of([(128, 0.0), (2048, 0.0)]),
                                                   prefill_scale=1.5)
    assert profile.prefill_time(2048, 2048**2) == pytest.approx(1.5 * bare)
    # profile-serving's engine time takes the scale it is given, not the profile's own.
    bare_profile = dataclasses.replace(profile, serving_overhead=None)
    assert engine_seconds(profile, 2048, 2048) == pytest.approx(bare)
    assert engine_seconds(bare_profile, 2048, 2048, 1.5) == pytest.approx(1.5 * bare)


def test_decode_scale_multiplies_every_simulated_decode_step(h100_profile: Path):
    profile = Profile.load(h100_profile)
    bare = profile.decode_time(32, 32 * 1000)
    profile.serving_overhead = dataclasses.replace(overhead_of([(128, 0.0), (2048, 0.0)]),
                                                   decode_scale=1.2)
    assert profile.decode_time(32, 32 * 1000) == pytest.approx(1.2 * bare)


def test_old_profile_files_load_without_an_overhead(tmp_path: Path):
    profile = Profile.load(REPO / "bench/results/pd_profile_h200.json")
    assert profile.serving_overhead is None and profile.overhead_time(2048) == 0.0
    profile.serving_overhead = overhead_of([(128, 0.03), (2048, 0.04)])
    profile.save(tmp_path / "with.json")
    again = Profile.load(tmp_path / "with.json")
    assert again.serving_overhead == profile.serving_overhead
    assert again.overhead_time(2048) == pytest.approx(0.04)


@pytest.mark.slow
def test_tune_adds_the_serving_overhead_to_ttft_only(h100_profile: Path, tmp_path: Path,
                                                      capsys):
    profile = Profile.load(h100_profile)
    profile.serving_overhead = overhead_of([(128, 0.030), (2048, 0.045)])
    with_overhead = tmp_path / "with.json"
    profile.save(with_overhead)
    args = ("--rate", "4", "--input-len", "2048", "--output-len", "64", "--gpus", "2")
    shifted = {r["config"]: r for r in tune(with_overhead, tmp_path / "with", *args)}
    assert "serving overhead: 29 ms + 0.00781 ms/token, prefill steps x1, decode steps x1, " \
        "measured through http://test" in capsys.readouterr().out
    bare = {r["config"]: r for r in tune(with_overhead, tmp_path / "bare", *args,
                                         "--no-serving-overhead")}
    assert "serving overhead" not in capsys.readouterr().out
    for config, r in bare.items():
        # The overhead loads no engine: every request's TTFT moves by exactly its overhead.
        assert shifted[config]["ttft"] == pytest.approx(r["ttft"] + 0.045), config
        assert shifted[config]["tpot"] == pytest.approx(r["tpot"]), config
    recorded = json.loads((tmp_path / "with" / "results.json").read_text())["serving_overhead"]
    assert recorded["coef"] == pytest.approx(profile.serving_overhead.coef)
    assert json.loads((tmp_path / "bare" / "results.json").read_text())["serving_overhead"] \
        is None


def test_an_overhead_measured_under_load_is_drawn_per_request_from_its_quantiles(
        h100_profile: Path):
    from pd_cluster.tuning.simulator import ClusterSpec, EngineLimits, Simulator, overhead_quantile
    import numpy as np
    # The quantile sequence covers (0, 1) evenly over any stretch of requests.
    qs = np.array([overhead_quantile(n) for n in range(7, 1007)])
    assert ((qs > 0) & (qs < 1)).all()
    assert np.histogram(qs, bins=10, range=(0, 1))[0] == pytest.approx([100] * 10, abs=3)
    profile = Profile.load(h100_profile)
    lengths, arrivals = [(256, 4)] * 400, np.arange(400) * 10.0    # far apart: no queue
    limits, spec = EngineLimits(400_000, 1e12, 2048), ClusterSpec(1, 1)
    bare = Simulator(profile, limits, spec).run(lengths, arrivals, 0.1).ttft
    # Under load: 20 ms to 120 ms, evenly; lone requests measured 30 ms (not used).
    profile.serving_overhead = dataclasses.replace(
        overhead_of([(128, 0.03), (2048, 0.03)]), under_load=list(np.linspace(0.02, 0.12, 21)),
        load={"prompt_tokens": 256})
    served = Simulator(profile, limits, spec).run(lengths, arrivals, 0.1).ttft
    added = served - bare
    assert added.min() >= 0.02 - 1e-9 and added.max() <= 0.12 + 1e-9
    assert np.percentile(added, [10, 50, 90]) == pytest.approx([0.03, 0.07, 0.11], abs=0.003)
    assert "serving overhead: 70 ms under load (p10 30, p90 110)" in \
        profile.serving_overhead.describe()


@pytest.mark.slow
def test_a_tensor_parallel_profile_counts_its_gpus_per_instance(h100_profile: Path,
                                                                 tmp_path: Path):
    """A profile of a TP=2 engine: every candidate's instances take 2 GPUs, so a budget of 5
    GPUs holds 2 instances, and the snippets give each replica 2 GPUs."""
    data = json.loads(h100_profile.read_text())
    data["engine"]["tensor_parallel_size"] = 2
    profile = tmp_path / "tp2.json"
    profile.write_text(json.dumps(data))
    assert Profile.load(profile).tensor_parallel_size == 2
    results = tune(profile, tmp_path / "out", "--rate", "0.2", "--gpus", "5")
    assert {(r["num_prefill"], r["num_decode"]) for r in results} == {(1, 1), (0, 1), (0, 2)}
    assert all(r["gpus"] == 2 * (r["num_prefill"] + r["num_decode"]) for r in results)
    assert all(r["tensor_parallel_size"] == 2 for r in results)
    args = yaml.safe_load((tmp_path / "out" / "pd-args.yaml").read_text())
    assert AppConfig.from_args(args).tensor_parallel_size("decode") == 2
    assert "tensorParallelSize: 2" in (tmp_path / "out" / "helm-values.yaml").read_text()
    assert "TP2" in (tmp_path / "out" / "table.txt").read_text()


@pytest.mark.slow
def test_planner_replay_of_a_shifting_mix_beats_the_best_fixed_pools(h100_profile: Path,
                                                                   tmp_path: Path, capsys):
    """Decode-heavy then prompt-heavy at 30 req/s on 8 GPUs: the planner moves the pools
    toward decode and then toward prefill, and its goodput per GPU beats every fixed P:D's
    over the same trace (the best fixed one is its starting point)."""
    assert main(["tune", "--profile", str(h100_profile), "-o", str(tmp_path), "--quiet",
                 "--planner", "--rate", "30", "--gpus", "8", "--ttft-slo", "1s",
                 "--tpot-slo", "25ms", "--phase", "128", "1024", "50s",
                 "--phase", "3072", "16", "50s", "--interval", "5s"]) == 0
    report = json.loads((tmp_path / "planner.json").read_text())
    planner, fixed = report["planner"], report["best_fixed"]
    assert planner["goodput_per_gpu"] > fixed["goodput_per_gpu"]
    actions = [row["action"] for row in planner["intervals"]]
    first, second = actions[:10], actions[10:]          # the two phases' intervals
    assert not any(a in ("add_prefill", "flip_to_prefill") for a in first)
    assert any(a in ("add_prefill", "flip_to_prefill") for a in second)
    assert "goodput per GPU: planner" in capsys.readouterr().out


def test_planner_replay_needs_a_rate_and_phases(h100_profile: Path, tmp_path: Path, capsys):
    assert main(["tune", "--profile", str(h100_profile), "-o", str(tmp_path), "--planner",
                 "--phase", "128", "512", "60s"]) == 2
    assert "--planner: needs --rate" in capsys.readouterr().err
