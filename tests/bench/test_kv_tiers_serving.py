"""bench/kv_tiers_serving.py end to end on the CPU (`--dry-run`: the tiny model, a few short
conversations): it serves the tiers-off and tiers-on applications on a local Ray, runs the
multi-turn benchmark against each through HTTP, writes one JSON with both runs and their
ratios, and leaves no process of its Ray behind. In a subprocess, as the lead runs it: the
script starts and stops a Ray of its own."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import REPO

pytestmark = [pytest.mark.slow, pytest.mark.serve]


def test_dry_run_serves_both_runs_and_writes_their_comparison(tmp_path: Path):
    out = tmp_path / "kv_tiers.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.kv_tiers_serving", "--dry-run",
                             "-o", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-3000:]
    data = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(data)
    result = data["result"]
    sizes, workload = result["sizes"], result["workload"]
    # The conversations in progress hold more KV than the engine's cache, and the host tier
    # is sized to hold all of it.
    assert sizes["ratio"] > 2 and sizes["host_holds_all"]
    assert result["app_args"]["engine"]["num_kv_blocks"] == sizes["gpu_kv_blocks"]
    requests = workload["conversations"] * workload["turns"]
    for label in ("off", "on"):
        run = result["runs"][label]
        assert run["completed"] == run["requests"] == requests, run["errors"]
        assert run["conversations_completed"] == workload["conversations"]
        turns = run["per_turn"]
        assert [t["turn"] for t in turns] == list(range(workload["turns"]))
        # Every turn after the first re-sends a longer context; the shared system prompt is
        # cached from the second conversation on.
        assert all(a["prompt_tokens_mean"] < b["prompt_tokens_mean"]
                   for a, b in itertools.pairwise(turns))
        assert run["cached_fraction"] > 0 and run["prefix_cache_hit_tokens"] > 0
        assert run["ttft_ms_p50"] <= run["ttft_ms_p90"] and run["goodput"] > 0
        columns = run["record_columns"]
        assert len(run["records"]) == requests and "cached_tokens" in columns
    # The tiers-on engine runs its tiers and offloads what it evicts; the other has none.
    assert result["runs"]["off"]["tier_stats"] == {}
    on = result["runs"]["on"]
    assert on["tier_stats"]["state"] == "on" and on["host_loads"]["offloaded"] > 0
    comparison = result["comparison"]
    assert comparison["ttft_p50_off_over_on"] > 0 and comparison["goodput_on_over_off"] > 0
    assert comparison["tiers_on_in_the_engine"]
    # Every Ray process of the script's own (its session lives under /tmp/pdkt<pid>-*) ended.
    mark = f"/tmp/pdkt{proc.pid}-"
    deadline = time.monotonic() + 30
    while (left := [p.pid for p in psutil.process_iter(["cmdline"])
                    if any(mark in a for a in p.info["cmdline"] or ())]) \
            and time.monotonic() < deadline:
        time.sleep(1)
    assert not left
