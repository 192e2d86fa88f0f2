"""The serving benchmarks (`bench/serving_sweep.py`: bench/harness/sweep.py served through
bench/serving_bench.py) on the CPU with the default model, as the GPU runs use them:
`sweep` serves disaggregated 1P1D and one colocated engine, benches two rates on each and
writes every field of sweep.json and a PNG; `validate` runs `pd-cluster tune` on a small
CPU-like profile, serves its recommendation, benches it at the same rate and writes a
consistent comparison.

Each served configuration takes 20-60 s to start on 2 cores: the two serving tests are marked
slow (`-m "not slow"` leaves them out), and they share one server of disagg:1:1 (the sweep's
last configuration is validate's recommendation: `KeptServer`), the session's default
application: configs/pd.yaml's args are disagg:1:1, and its API key goes with every request
(OPENAI_API_KEY, which `pd-cluster bench` and `profile-serving` read).
"""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support import REPO as ROOT
from bench.harness.sweep import run, summary
from bench.harness.diagnostics import PARTS, join_parts
from bench.harness.serving_runs import RECORD_COLUMNS, Deployment, app_args
from pd_cluster.tuning.profile import DECODE_FEATURES, PREFILL_FEATURES, LatencyModel, Profile
from tests.support.ray_cluster import environ, stop_shared_ray
from router.app_config import AppConfig

SERVE_CONFIG = ROOT / "configs" / "pd.yaml"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LATENCIES = ("ttft", "tpot", "itl", "e2e")
# Short requests and SLOs loose enough for a shared 2-core machine.
LOAD = ["--input-len", "24", "--output-len", "6", "--ttft-slo", "5s", "--tpot-slo", "1s",
        "--warmup-requests", "2", "--num-cpus", "2"]


def test_configurations_translate_to_app_args():
    assert Deployment.parse("disagg:2:1").args() == {"mode": "disaggregated", "num_prefill": 2,
                                                     "num_decode": 1}
    colo = Deployment.parse("colo:2")
    assert colo.args() == {"mode": "colocated", "num_prefill": 0, "num_decode": 2}
    assert (str(colo), colo.gpus) == ("colo:2", 2)
    assert str(Deployment(1, 3)) == "disagg:1:3"        # a tune row (P, D) names its config
    with pytest.raises(ValueError, match="disagg:P:D or colo:N"):
        Deployment.parse("pooled:1")
    args = app_args(["engine.dtype=bfloat16", "limits.max_queue=1024",
                     "engine.max_model_len=4096"], SERVE_CONFIG)
    config = AppConfig.from_args(args)
    assert (config.engine.dtype, config.limits.max_queue, config.engine.max_model_len) == \
        ("bfloat16", 1024, 4096)
    assert config.limits.max_tokens == 4096 and "api_key_env" not in args


def records_of(point: dict) -> list[dict]:
    return [dict(zip(RECORD_COLUMNS, row)) for row in point["records"]]


@pytest.fixture(scope="module")
def harness() -> Iterator:
    """The benchmarks' harness (router/serving_bench.py), keeping its last server for the next
    test of the module."""
    pytest.importorskip("ray")
    from bench.serving_bench import LocalRayHarness
    from tests.support.serve_run import API_KEY

    class KeptServer(LocalRayHarness):
        """Serves each configuration on a local Ray of its own, as LocalRayHarness does, but
        keeps the last one running after its block: the next block asking for the same args
        gets it (starting one takes 20-60 s on 2 cores); any other stops it first. The
        default application's args (configs/pd.yaml's, disagg:1:1) get the session's
        `default_server` instead (`default_server_later`, set by each test), which stays up."""

        def __init__(self) -> None:
            self.kept: tuple[dict, contextlib.ExitStack, str] | None = None
            self.default_server: Callable[[], str] | None = None
            self.default_served = False

        @contextlib.contextmanager
        def serving(self, args, opts) -> Iterator[str]:
            if self.default_server is not None and args == app_args([], SERVE_CONFIG):
                self.close()
                self.default_served = True
                with environ({"OPENAI_API_KEY": API_KEY}):
                    yield self.default_server()
                return
            if self.default_served:     # starting a Ray here would stop default_server's
                raise RuntimeError("serve other configurations before the default one")
            if self.kept is None or self.kept[0] != args:
                self.close()
                stop_shared_ray()       # the actor tests' Ray, if it runs
                stack = contextlib.ExitStack()
                url = stack.enter_context(super().serving(args, opts))
                self.kept = (args, stack, url)
            yield self.kept[2]

        def close(self) -> None:
            if self.kept is not None:
                kept, self.kept = self.kept, None
                kept[1].close()

    kept = KeptServer()
    yield kept
    kept.close()


def serving_bench(argv: list[str], harness) -> int:
    """`bench/serving_sweep.py ARGV`, served through `harness`."""
    return run(argv, harness, SERVE_CONFIG)


@pytest.mark.slow
@pytest.mark.serve
def test_sweep_measures_every_rate_of_each_configuration(tmp_path: Path, harness,
                                                         default_server_later):
    out = tmp_path / "sweep"
    harness.default_server = default_server_later
    # disagg:1:1 last: the default application, still up for validate's recommendation.
    serving_bench(["sweep", "--configs", "colo:1,disagg:1:1", "--rates", "1,2",
                   "--window", "3", "--settle", "0.5", "--stop-below", "0",
                   "--budget-s", "3000", *LOAD,
                   "-o", str(out)], harness)
    result = json.loads((out / "sweep.json").read_text())
    assert result["command"].startswith("python3 bench/serving_sweep.py sweep")
    assert result["slo"] == {"ttft": 5.0, "tpot": 1.0, "percentile": 90.0}
    assert set(result["definitions"]) >= {"goodput", "kv_transfer", "window"}
    assert [c["config"] for c in result["configs"]] == ["colo:1", "disagg:1:1"]
    for config in result["configs"]:
        assert "error" not in config, config["error"]
        assert config["start_s"] > 0 and min(config["kv_capacity_tokens"].values()) > 0
        assert [p["rate"] for p in config["points"]] == [1.0, 2.0], config["skipped"]
        for point in config["points"]:
            check_point(point, config, result["slo"])
            stages = point["engine_stages"]
            if config["mode"] == "colocated":
                assert stages is None
            else:   # P's and D's own stamps of the run's requests
                assert stages["queue_prefill"]["n"] > 0 and stages["landing"]["n"] > 0, stages
                line = stages["prefill_timeline"]   # P's raw stamps and engine steps
                assert len(line["requests"]) == stages["queue_prefill"]["n"]
                assert line["steps"] and line["busy_ms"] > 0
    per = result["summary"]["configs"]
    assert set(per) == {"disagg:1:1", "colo:1"}
    for config in result["configs"]:
        met = [p for p in config["points"] if p["slo_attained"]]
        assert per[config["config"]]["goodput_per_gpu_meeting_slo"] == pytest.approx(
            max((p["goodput_per_gpu"] for p in met), default=0.0))
    ratio = result["summary"]["disagg_over_colocated"]["disagg:1:1 / colo:1"]
    if per["colo:1"]["goodput_per_gpu_meeting_slo"] > 0:
        assert ratio["goodput_per_gpu_meeting_slo"] == pytest.approx(
            per["disagg:1:1"]["goodput_per_gpu_meeting_slo"]
            / per["colo:1"]["goodput_per_gpu_meeting_slo"])
    png = (out / "sweep.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    import matplotlib.pyplot as plt
    assert plt.imread(out / "sweep.png").shape[2] in (3, 4)


def check_point(point: dict, config: dict, slo: dict) -> None:
    """Every field present, and the numbers agree with the per-request records."""
    records = records_of(point)
    assert point["measured"] == len(records) >= 1
    assert all(0.5 <= r["start"] < 3.5 for r in records)            # the measured window
    assert point["completed"] == sum(r["ok"] for r in records)
    assert point["failed"] == 0, point["errors"]
    assert all(r["output_tokens"] == 6 for r in records)
    for name in LATENCIES:
        d = point[name]
        assert set(d) == {"mean", "p50", "p90", "p99"} and d["p50"] <= d["p90"] <= d["p99"]
    assert point["ttft"]["p90"] == pytest.approx(np.percentile([r["ttft"] for r in records], 90),
                                                 abs=1e-5)
    met = [r["ok"] and r["ttft"] <= slo["ttft"] and r["tpot"] <= slo["tpot"] for r in records]
    assert [r["met_slo"] for r in records] == met
    assert point["slo_attainment"] == pytest.approx(sum(met) / len(met))
    assert point["slo_attained"] == (point["slo_attainment"] >= 0.9)
    assert point["goodput"] == pytest.approx(point["slo_attainment"] * point["rate"])
    assert point["goodput_per_gpu"] == pytest.approx(point["goodput"] / config["gpus"])
    assert point["rate_per_gpu"] == pytest.approx(point["rate"] / config["gpus"])
    assert point["output_token_throughput"] > 0 and point["achieved_rate"] > 0
    assert point["whole_run"]["requests"] >= point["measured"]
    kv = point["kv_transfer"]
    if config["mode"] == "disaggregated":
        # Every request of the run (settle included) went through P and moved its KV.
        assert kv["transfers"] == point["whole_run"]["requests"]
        assert kv["seconds_per_request"] > 0 and kv["bytes_per_request"] > 0
        assert 0 < kv["share_of_ttft"] < 1
    else:
        assert kv == {"transfers": 0, "seconds_per_request": None, "bytes_per_request": None,
                      "share_of_ttft": None}


@pytest.fixture
def cpu_profile(tmp_path: Path) -> Path:
    """SmolLM2-135M in float32 on one core of this machine, roughly (`pd-cluster profile`
    with a small grid fits about these); KV room for many requests."""
    path = tmp_path / "cpu.json"
    Profile(machine={"cpu": "2-core CPU (synthetic)", "device": "cpu"},
            model={"name": "SmolLM2-135M-Instruct", "dtype": "float32",
                   "kv_bytes_per_token": 46080},
            date="2026-01-01T00:00:00+00:00",
            engine={"block_size": 16, "kv_capacity_tokens": 20000},
            prefill=LatencyModel(PREFILL_FEATURES, [2.2e-3, 7.5e-7, 0.12]),
            decode=LatencyModel(DECODE_FEATURES, [5.5e-5, 0.021, 0.06])).save(path)
    return path


@pytest.mark.slow
@pytest.mark.serve
def test_validate_compares_tune_prediction_with_bench(tmp_path: Path, cpu_profile: Path,
                                                      harness, default_server_later):
    out = tmp_path / "validate"
    harness.default_server = default_server_later
    serving_bench(["validate", "--profile", str(cpu_profile), "--rates", "2", "--gpus", "2",
                   "--no-colocated",
                   "--requests", "6", "--tune-requests", "50", *LOAD,
                   "--ttft-slo", "2s", "--tpot-slo", "500ms",
                   "--serving-overhead-lengths", "16,64", "--serving-load-requests", "6",
                   "-o", str(out)], harness)
    result = json.loads((out / "validate.json").read_text())
    assert "errors" not in result, result["errors"]
    # The overhead was measured on the served config and tune reran with it.
    assert result["profile"] == "cpu_serving.json"
    served = Profile.load(out / "cpu_serving.json").serving_overhead
    assert served is not None and served.load["requests"] == 6
    assert served.load["input_len"] == 24 and served.load["output_len"] == 6   # the workload's
    assert set(result["definitions"]) >= {"ttft", "tpot", "goodput", "warm_up"}
    [point] = result["points"]
    assert point["config"] == "disagg:1:1" and point["rate"] == 2.0  # the only candidate
    predicted, measured = point["predicted"], point["measured"]
    assert "1P1D" in predicted["tune_table"]
    # tune's warm-up: ceil(rate x (TTFT SLO + (output - 1) x TPOT SLO)) = ceil(2 x 4.5) = 9.
    assert measured["warm_up_requests"] == 9 and measured["measured"] == 6
    assert measured["whole_run"]["requests"] == 6 + 2 * 9
    assert [r["index"] for r in records_of(measured)] == list(range(9, 15))
    assert set(point["checks"]) == {"ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput"}
    for name, check in point["checks"].items():
        assert check["predicted"] == predicted[name] and check["measured"] == measured[name]
        if check["predicted"]:
            err = (check["measured"] - check["predicted"]) / check["predicted"]
            assert check["relative_error"] == pytest.approx(err)
            assert check["within"] == (abs(err) <= 0.15)
    assert point["pass"] == all(c["within"] for c in point["checks"].values())
    assert predicted["ttft_p50"] <= predicted["ttft_p90"]
    assert predicted["serving_overhead"] is not None
    assert measured["goodput"] in (0.0, pytest.approx(measured["slo_attainment"] * 2.0))
    assert point["diagnosis"]["profile_decode_step_s"] > 0
    assert math.isfinite(point["diagnosis"]["decode_batch_per_instance"])
    assert (out / "tune_goodput_per_gpu.png").read_bytes().startswith(PNG_SIGNATURE)
    # The same simulator on bench's own arrivals, judged the same way.
    replayed = point["on_measured_arrivals"]
    assert set(replayed["checks"]) == set(point["checks"])
    for name, check in replayed["checks"].items():
        assert check["predicted"] == replayed["predicted"][name]
        assert check["measured"] == measured[name]
    assert replayed["pass"] == all(c["within"] for c in replayed["checks"].values())
    # Every measured request's TTFT, cut at P's own stamps: the parts add up to it.
    parts = measured["ttft_parts"]
    assert parts["joined"] == parts["of"] == 6 and len(parts["rows_ms"]) == 6
    ttfts = sorted(r["ttft"] * 1e3 for r in records_of(measured))
    assert sorted(sum(row) for row in parts["rows_ms"]) == pytest.approx(ttfts, abs=0.05)
    assert all(part >= 0 for row in parts["rows_ms"] for part in row)
    assert parts["prefill_steps_ms"]["n"] > 0
    # The server's own split: the serving path (TTFT less the engine's share) of each request.
    path = measured["serving_path_ms"]
    assert 0 <= path["p10"] <= path["p50"] <= path["p90"]


def test_summary_interpolates_where_attainment_crosses_the_percentile():
    def point(rate: float, attainment: float) -> dict:
        return {"rate": rate, "slo_attainment": attainment, "slo_attained": attainment >= 0.9,
                "goodput_per_gpu": attainment * rate / 2}
    configs = [{"config": "disagg:1:1", "gpus": 2,
                "points": [point(4, 1.0), point(8, 0.95), point(12, 0.75)]},
               {"config": "colo:2", "gpus": 2, "points": [point(4, 1.0), point(8, 0.5)]}]
    result = summary(configs, 90.0)
    disagg, colo = result["configs"]["disagg:1:1"], result["configs"]["colo:2"]
    assert disagg["max_rate_meeting_slo"] == 8 and colo["max_rate_meeting_slo"] == 4
    assert disagg["crossing_rate"] == pytest.approx(8 + 4 * 0.05 / 0.2)        # 9 req/s
    assert colo["crossing_rate_per_gpu"] == pytest.approx((4 + 4 * 0.1 / 0.5) / 2)
    ratio = result["disagg_over_colocated"]["disagg:1:1 / colo:2"]
    assert ratio["goodput_per_gpu_meeting_slo"] == pytest.approx(0.95 * 8 / 4)
    assert ratio["crossing_rate_per_gpu"] == pytest.approx(9 / 4.8)
    assert not disagg["lower_bound"] and not colo["lower_bound"] and ratio["bound"] == "exact"


def test_summary_marks_a_limit_no_rate_reached_as_a_lower_bound():
    # colo:2 met the SLOs at every rate it ran (its higher rates skipped for time): its limit
    # is at least 14, so disaggregated over colocated is at most the ratio computed.
    def point(rate: float, attainment: float) -> dict:
        return {"rate": rate, "slo_attainment": attainment, "slo_attained": attainment >= 0.9,
                "goodput_per_gpu": attainment * rate / 2}
    configs = [{"config": "disagg:1:1", "gpus": 2, "points": [point(6, 1.0), point(10, 0.5)]},
               {"config": "colo:2", "gpus": 2, "points": [point(6, 1.0), point(14, 1.0)]}]
    result = summary(configs, 90.0)
    assert result["configs"]["colo:2"]["lower_bound"]
    assert not result["configs"]["disagg:1:1"]["lower_bound"]
    assert result["disagg_over_colocated"]["disagg:1:1 / colo:2"]["bound"] == "at most"
    configs[0]["points"].pop()          # disagg also stopped while still meeting them
    assert summary(configs, 90.0)["disagg_over_colocated"][
        "disagg:1:1 / colo:2"]["bound"].startswith("unknown")


@pytest.mark.slow
def test_rejudge_applies_other_slos_to_the_same_requests(tmp_path: Path):
    # Two configs, one point each, ten requests: TPOT 6 ms for disagg, 12 ms for colocated.
    def point(rate: float, gpus: int, tpot: float) -> dict:
        rows = [dict(index=i, start=0.1 * i, ok=True, prompt_tokens=2048, output_tokens=256,
                     ttft=0.2, tpot=tpot, e2e=0.2 + 255 * tpot, met_slo=True) for i in range(10)]
        return {"rate": rate, "rate_per_gpu": rate / gpus, "slo_attainment": 1.0,
                "slo_attained": True, "goodput": rate, "goodput_per_gpu": rate / gpus,
                "ttft": {"p50": 0.2, "p90": 0.2}, "tpot": {"p50": tpot, "p90": tpot},
                "records": [[r[c] for c in RECORD_COLUMNS] for r in rows]}
    sweep = {"workload": "2048 -> 256", "slo_text": "TTFT <= 1000 ms and TPOT <= 25 ms for p90",
             "slo": {"ttft": 1.0, "tpot": 0.025, "percentile": 90.0},
             "configs": [{"config": "disagg:1:1", "gpus": 2, "points": [point(16, 2, 0.006)]},
                         {"config": "colo:2", "gpus": 2, "points": [point(16, 2, 0.012)]}]}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    out = tmp_path / "tight" / "sweep_tpot10ms.json"
    assert run(["rejudge", str(tmp_path / "sweep.json"), "--tpot-slo", "10ms",
                "-o", str(out)], None, SERVE_CONFIG) == 0
    result = json.loads(out.read_text())
    assert result["rejudged_from"]["file"] == "sweep.json"
    assert result["slo"]["tpot"] == pytest.approx(0.010)
    disagg, colo = (c["points"][0] for c in result["configs"])
    assert disagg["slo_attained"] and disagg["goodput_per_gpu"] == 8.0
    assert colo["slo_attainment"] == 0.0 and colo["goodput"] == 0.0
    met = RECORD_COLUMNS.index("met_slo")
    assert all(r[met] for r in disagg["records"]) and not any(r[met] for r in colo["records"])
    # Colocated met the tighter SLO at no rate: the ratio is a bound from its lowest rate.
    ratio = result["summary"]["disagg_over_colocated"]["disagg:1:1 / colo:2"]
    assert ratio["goodput_per_gpu_meeting_slo"] == 1.0 and ratio["bound"].startswith("more than")
    assert out.with_suffix(".png").read_bytes().startswith(PNG_SIGNATURE)


def test_ttft_parts_join_bench_records_with_router_and_prefill_stamps():
    records = [{"response_id": "cmpl-a", "start": 1.0, "ttft": 0.2, "ok": True},
               {"response_id": "cmpl-b", "start": 2.0, "ttft": 0.3, "ok": True},
               {"response_id": "cmpl-c", "start": 3.0, "ttft": None, "ok": False},
               {"response_id": "cmpl-d", "start": 4.0, "ttft": 0.1, "ok": True}]  # no P stamps
    router = {"cmpl-a-0": (101.004, 101.17), "cmpl-b-0": (102.01, 102.28),
              "cmpl-c-0": (103.0, 103.3), "cmpl-d-0": (104.0, 104.05)}
    prefill = {"cmpl-a-0": (101.01, 101.15, 101.15, 101.16),  # D's blocks known first
               "cmpl-b-0": (102.02, 102.20, 102.25, 102.26),  # known after the first token
               "cmpl-c-0": (103.01, 103.2, 103.2, 103.3)}
    parts = join_parts(records, 100.0, router, prefill)
    assert parts.shape == (2, len(PARTS))
    assert parts[0] == pytest.approx([0.004, 0.006, 0.14, 0.0, 0.01, 0.01, 0.03])
    assert parts[1] == pytest.approx([0.01, 0.01, 0.18, 0.05, 0.01, 0.02, 0.02])
    assert parts.sum(axis=1) == pytest.approx([0.2, 0.3])     # the parts are the TTFT
    assert join_parts(records, None, router, prefill).shape == (0, len(PARTS))
