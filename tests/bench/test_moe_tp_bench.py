"""bench/tp_bench.py's MoE path end to end on the CPU, on the tiny-qwen3-moe shape: one size
and an expert-parallel one (two CPU ranks), its decode rows carrying the counted experts and
the roofline built on them, prefill, and the ratios named by size. What needs CUDA is stood
in for: the device's name, its synchronize, the copy rate (1 TB/s) and the profile of
collectives (a CUDA profiler)."""
from __future__ import annotations

import argparse
from unittest import mock

import pytest
import torch

from bench import tp_bench
from bench.models import SHAPES, decode_weight_bytes, expected_routed_experts
from pd_cluster.models.moe import COUNT_ROUTED

pytestmark = pytest.mark.slow       # engines of a 151936-token vocabulary, in bf16 on 2 cores

BANDWIDTH = 1e12
STEPS = 2


def run(tp: int, expert_parallel: bool, monkeypatch) -> dict:
    monkeypatch.setenv(COUNT_ROUTED, "0")       # run_one turns it on; restored after
    args = argparse.Namespace(shape="tiny-qwen3-moe", tp_one=tp, expert_parallel=expert_parallel,
                              batches="4", context=24, steps=STEPS, prefill="1x16",
                              quantization=None, kv_cache_dtype="auto", engine=[],
                              no_count_experts=False, top_kernels=12)
    with mock.patch.object(torch.cuda, "get_device_name", lambda *a: "cpu"), \
            mock.patch.object(torch.cuda, "synchronize", lambda *a: None), \
            mock.patch.object(tp_bench, "copy_bandwidth", lambda: BANDWIDTH), \
            mock.patch.object(tp_bench, "collective_ms", lambda *a, **k: {}):
        return tp_bench.run_one(args)


def check_decode(res: dict, tp: int, ep: bool) -> None:
    cfg = SHAPES["tiny-qwen3-moe"]
    (row,) = res["decode"]
    routed = row["routed_experts_per_layer"]
    assert routed["forwards"] == STEPS and row["running"] == 4
    assert 2 <= routed["measured"] <= 8 and routed["measured_per_gpu"] <= routed["measured"]
    assert routed["expected"] == expected_routed_experts(8, 2, 4)
    weight = decode_weight_bytes(cfg, 4, tp, ep, routed["measured_per_gpu"])
    kv = row["mean_context"] * 4 * res["kv_bytes_per_token_per_gpu"]
    assert row["roofline_ms"] == pytest.approx((weight + kv) / BANDWIDTH * 1e3)
    assert row["roofline_expected_ms"] == pytest.approx(
        (decode_weight_bytes(cfg, 4, tp, ep) + kv) / BANDWIDTH * 1e3)
    assert row["ratio_to_roofline"] == pytest.approx(row["step_ms"] / row["roofline_ms"])
    assert res["prefill"]["tok_s"] > 0


def test_one_gpus_run_counts_the_routed_experts_and_bases_its_roofline_on_them(monkeypatch):
    res = run(1, False, monkeypatch)
    assert res["moe"]["experts_per_gpu"] == 8 and "expert_parallel" not in res
    check_decode(res, 1, False)
    routed = res["decode"][0]["routed_experts_per_layer"]
    assert routed["measured_per_gpu"] == routed["measured"]


def test_an_expert_parallel_run_reads_the_busiest_ranks_experts(monkeypatch):
    res = run(2, True, monkeypatch)
    assert res["expert_parallel"] is True
    assert res["moe"]["experts_per_gpu"] == 4
    check_decode(res, 2, True)
    routed = res["decode"][0]["routed_experts_per_layer"]
    # The busiest of two ranks holds at least half of the experts routed to.
    assert routed["measured"] / 2 <= routed["measured_per_gpu"] <= 4
    assert routed["expected_per_gpu"] == expected_routed_experts(8, 2, 4) / 2
    assert tp_bench.label(res) == "ep2"
    assert tp_bench.ratios(res, res) == {"decode_b4_tok_s": 1.0, "prefill_tok_s": 1.0}
