"""`pd-cluster profile` on the bundled default model, on the CPU: the fitted DistServe models
predict the held-back measurements within 15 % (mean relative error), and the profile file
holds what `tune` and a reader need (machine, model, dtype, date, samples, coefficients).

The grid is small so the test takes under a minute on 2 cores; each point is the median of
three passes taken in a fresh random order, which keeps bursts of other load on the machine
from skewing any one point.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pd_cluster.cli import main
from pd_cluster.tuning.profile import Profile

MAX_MEAN_ERROR_PCT = 15.0
# The profile takes most of a minute on 2 cores (more on a busy machine).
profiled = pytest.mark.slow


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory, default_model_dir: str) -> Path:
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    assert main(["profile", "--model", default_model_dir, "--device", "cpu", "-o", str(path),
                 "--prefill-tokens", "16,32,64,128,192,256,384", "--prefill-splits", "1,2,4",
                 "--decode-batches", "1,2,4,8,16", "--decode-contexts", "64,192,320,512",
                 "--passes", "3", "--decode-steps", "3", "--quiet"]) == 0
    return path


@profiled
def test_fit_predicts_held_back_points_within_15_percent(profile_path: Path):
    profile = Profile.load(profile_path)
    for model in (profile.prefill, profile.decode):
        held = [s for s in model.samples if s.held_out]
        assert len(held) >= 0.15 * len(model.samples)
        # Recompute the error from the raw samples rather than trusting the stored figure.
        errors = [abs(model.predict(s.features) - s.seconds) / s.seconds for s in held]
        mean_pct = 100 * sum(errors) / len(errors)
        assert mean_pct == pytest.approx(model.error.mean_abs_pct)
        assert mean_pct <= MAX_MEAN_ERROR_PCT, (model.features, model.coef, mean_pct)
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
