"""`pd-cluster profile` on the bundled default model, on the CPU, and the latency models it fits.

The fit is proven on synthetic steps with known costs and noise (deterministic): it recovers
the costs and predicts held-back steps within 15 %. The real profile run checks what the file
holds (machine, model, dtype, date, samples, coefficients) and that the error it reports is the
error of its own held-back points; how well the fit predicts real step times on real hardware
is a measurement (`pd-cluster profile` prints it), not something a shared 2-core CI machine
can assert.

The grid is small (prompts up to 192 tokens, contexts up to 128) and measured in one pass (the
median of several is the product's default, not what these assertions need), so the profile
takes about a quarter of a minute on 2 cores.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pd_cluster.cli import main
from pd_cluster.tuning.profile import LatencyModel, Profile, Sample, decode_features

MAX_MEAN_ERROR_PCT = 15.0
# The profile takes about a quarter of a minute on 2 cores (more on a busy machine).
profiled = pytest.mark.slow


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory, default_model_dir: str) -> Path:
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    assert main(["profile", "--model", default_model_dir, "--device", "cpu", "-o", str(path),
                 "--prefill-tokens", "16,32,48,64,96,128,192", "--prefill-splits", "1,2,4",
                 "--decode-batches", "1,2,4,8,16", "--decode-contexts", "16,32,64,128",
                 "--passes", "1", "--decode-steps", "3", "--quiet"]) == 0
    return path


def test_fit_recovers_known_costs_and_predicts_held_back_steps_within_15_percent():
    rng = random.Random(0)
    true_coef = [3e-5, 8e-3, 4.7e-2]                  # per context token, per sequence, fixed
    samples = []
    shapes = [(batch, ctx) for batch in (1, 2, 4, 8, 16, 32) for ctx in (64, 256, 1024)]
    for i, (batch, ctx) in enumerate(shapes):
        features = decode_features(batch, batch * ctx)
        seconds = sum(c * f for c, f in zip(true_coef, features)) * rng.uniform(0.92, 1.08)
        samples.append(Sample(features, seconds, held_out=i % 5 == 0))
    model = LatencyModel.fit(("sum_ctx", "batch", "const"), samples)
    assert model.error.num_held_out == 4
    assert model.error.mean_abs_pct <= MAX_MEAN_ERROR_PCT
    for fitted, true in zip(model.coef, true_coef):
        assert fitted == pytest.approx(true, rel=0.15)


@profiled
def test_profile_reports_the_error_of_its_own_held_back_points(profile_path: Path):
    profile = Profile.load(profile_path)
    for model in (profile.prefill, profile.decode):
        held = [s for s in model.samples if s.held_out]
        assert len(held) >= 0.15 * len(model.samples)
        # Recompute the error from the raw samples rather than trusting the stored figure.
        errors = [abs(model.predict(s.features) - s.seconds) / s.seconds for s in held]
        assert 100 * sum(errors) / len(errors) == pytest.approx(model.error.mean_abs_pct)
        assert all(c >= 0 for c in model.coef)


@profiled
def test_profile_file_records_machine_model_and_date(profile_path: Path, default_model_dir):
    data = json.loads(profile_path.read_text())
    assert data["machine"]["device"] == "cpu" and data["machine"]["cpu"]
    assert data["model"]["name"] == Path(default_model_dir).name
    assert data["model"]["dtype"] == "float32"
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32: K and V.
    assert data["model"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert data["date"][:2] == "20" and data["engine"]["kv_capacity_tokens"] > 0
    assert data["prefill"]["features"] == ["sum_tokens", "sum_sq_tokens", "const"]
    assert data["decode"]["features"] == ["sum_ctx", "batch", "const"]
    assert len(data["prefill"]["samples"]) == 20 and len(data["decode"]["samples"]) == 20


@profiled
def test_longer_steps_cost_more(profile_path: Path):
    profile = Profile.load(profile_path)
    assert profile.prefill_time(512, 512 ** 2) > profile.prefill_time(64, 64 ** 2)
    assert profile.decode_time(16, 16 * 512) > profile.decode_time(1, 64)


def test_bad_profile_grid_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--prefill-tokens", "16,abc"])
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tensor_parallel_engine_is_profiled_and_recorded(tmp_path: Path, tiny_model_root):
    """`--tensor-parallel-size 2` measures a 2-rank engine (gloo on the CPU) and the file says
    so: `tune` then counts 2 GPUs per instance."""
    from tests.support.tiny_models import make_tiny_model

    path = tmp_path / "tp2.json"
    assert main(["profile", "--model", make_tiny_model("llama_gqa", tiny_model_root),
                 "--device", "cpu", "--tensor-parallel-size", "2", "-o", str(path),
                 "--prefill-tokens", "16,32,64", "--prefill-splits", "1,2",
                 "--decode-batches", "1,2,4", "--decode-contexts", "32,64", "--passes", "1",
                 "--decode-steps", "2", "--held-out", "0", "--quiet"]) == 0
    profile = Profile.load(path)
    assert profile.tensor_parallel_size == 2
    assert profile.prefill.coef and profile.decode.coef
