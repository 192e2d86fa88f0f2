"""bench/tp_bench.py's DeepSeek path end to end on the CPU, on the tiny-deepseek-v2 shape at
two contexts: each batch's decode row at each context, with the experts its DeepSeek MoE
layer counted, the roofline over those and the latent KV bytes a token, and the ratios named
by batch and context. What needs CUDA is stood in for: the device's name, its synchronize,
the copy rate (1 TB/s) and the profile of collectives (a CUDA profiler)."""
from __future__ import annotations

import argparse
from unittest import mock

import pytest
import torch

from bench import tp_bench
from bench.models import SHAPES, decode_weight_bytes, expected_routed_experts
from pd_cluster.models.moe import COUNT_ROUTED

pytestmark = pytest.mark.slow       # an engine of a 102400-token vocabulary in bf16 on 2 cores

BANDWIDTH = 1e12
STEPS = 2


def test_decode_rows_per_batch_and_context_take_the_counted_experts_and_latent_kv(monkeypatch):
    cfg = SHAPES["tiny-deepseek-v2"]
    monkeypatch.setenv(COUNT_ROUTED, "0")       # run_one turns it on; restored after
    args = argparse.Namespace(shape="tiny-deepseek-v2", tp_one=1, expert_parallel=False,
                              batches="2,4", context="24,40", steps=STEPS, prefill="",
                              quantization=None, kv_cache_dtype="auto", engine=[],
                              no_count_experts=False, top_kernels=12)
    with mock.patch.object(torch.cuda, "get_device_name", lambda *a: "cpu"), \
            mock.patch.object(torch.cuda, "synchronize", lambda *a: None), \
            mock.patch.object(tp_bench, "copy_bandwidth", lambda: BANDWIDTH), \
            mock.patch.object(tp_bench, "collective_ms", lambda *a, **k: {}):
        res = tp_bench.run_one(args)
    kv_token = 2 * (32 + 8) * 2           # layers x (kv_lora_rank + RoPE dim) x bf16
    assert res["kv_bytes_per_token"] == res["kv_bytes_per_token_per_gpu"] == kv_token
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(2, 24), (4, 24), (2, 40),
                                                                   (4, 40)]
    for row in res["decode"]:
        b = row["batch"]
        routed = row["routed_experts_per_layer"]
        assert routed["forwards"] == STEPS and row["running"] == b
        assert 2 <= routed["measured"] <= 8
        assert routed["expected"] == expected_routed_experts(8, 2, b)
        assert row["context"] <= row["mean_context"] <= row["context"] + 3 + STEPS
        kv = row["mean_context"] * b * kv_token
        weight = decode_weight_bytes(cfg, b, 1, False, routed["measured_per_gpu"])
        assert row["roofline_ms"] == pytest.approx((weight + kv) / BANDWIDTH * 1e3)
        assert row["ratio_to_roofline"] == pytest.approx(row["step_ms"] / row["roofline_ms"])
    assert set(tp_bench.ratios(res, res)) == {f"decode_b{b}_c{c}_tok_s" for b in (2, 4)
                                              for c in (24, 40)}
