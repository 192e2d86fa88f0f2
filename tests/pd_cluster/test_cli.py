"""The `pd-cluster` console script, run as a user would."""
import json
import subprocess
import sys

import pytest


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pd_cluster.cli", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_generate_prints_the_default_models_answer(default_model_dir):
    r = _cli("generate", "The capital of France is", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"].strip().startswith("Paris")


@pytest.mark.slow
def test_generate_reports_bad_input_without_a_traceback(default_model_dir):
    r = _cli("generate", "hi", "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature" in r.stderr and "Traceback" not in r.stderr
