"""The MoE decode roofline's arithmetic (bench/models.py) and its measured side
(bench/tp_bench.py RoutedExperts over pd_cluster/models/moe.py's counters), on the CPU: the
uniform routing's expected union of experts, Qwen3-30B-A3B's bytes, the dense shapes'
bytes as before, the dummy model directory read by our loader and by transformers, and the
counters' distinct experts per step and per expert-parallel rank."""
from __future__ import annotations

import random

import pytest
import torch

from bench.models import (QWEN3_30B_A3B, SHAPES, decode_weight_bytes, dummy_model_dir,
                          expected_routed_experts, expert_bytes, kv_bytes_per_token, moe_layers,
                          params_bytes, resident_weight_bytes)
from bench.tp_bench import RoutedExperts, label
from pd_cluster.config import ModelConfig
from pd_cluster.models.llama import LlamaForCausalLM
from pd_cluster.models.loader import load_model
from pd_cluster.models.moe import COUNT_ROUTED, SparseMoE
from tests.support.tiny_models import make_tiny_model


def test_expected_union_is_k_for_one_token_and_matches_uniform_routing():
    assert expected_routed_experts(128, 8, 1) == pytest.approx(8)
    assert expected_routed_experts(128, 8, 0) == 0
    assert expected_routed_experts(128, 8, 10_000) == pytest.approx(128)
    # One of two expert-parallel ranks expects half.
    assert expected_routed_experts(128, 8, 64, local=64) == pytest.approx(
        expected_routed_experts(128, 8, 64) / 2)
    # Against a simulation: T tokens, each top-8 distinct experts of 128, uniformly.
    rng = random.Random(0)
    for tokens in (1, 4, 16, 64):
        trials = [len({e for _ in range(tokens) for e in rng.sample(range(128), 8)})
                  for _ in range(400)]
        assert sum(trials) / len(trials) == pytest.approx(
            expected_routed_experts(128, 8, tokens), rel=0.02)


def test_qwen3_30b_a3b_bytes():
    cfg = SHAPES["qwen3-30b-a3b"]
    assert expert_bytes(cfg) == 3 * 2048 * 768 * 2
    assert moe_layers(cfg) == 48
    assert kv_bytes_per_token(cfg) == 2 * 48 * 4 * 128 * 2      # head_dim 128, not 2048 / 32
    attention = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048
    norms = 2 * 2048 + 2 * 128
    router = 128 * 2048
    non_expert = 2 * (48 * (attention + norms + router) + 151936 * 2048 + 2048)
    assert params_bytes(cfg) == non_expert
    # Every expert read: about 61 GB in bf16 with the embedding, as published.
    every = non_expert + 48 * 128 * expert_bytes(cfg)
    assert resident_weight_bytes(cfg) == every
    assert 60e9 < every + 151936 * 2048 * 2 < 62e9
    union = expected_routed_experts(128, 8, 64)
    assert 125 < union < 127
    assert decode_weight_bytes(cfg, 64) == pytest.approx(non_expert
                                                         + 48 * union * expert_bytes(cfg))
    # EP=2: half the non-expert weights, whole experts among 64; TP=2: a half of each of all.
    assert decode_weight_bytes(cfg, 64, 2, True) == pytest.approx(
        non_expert / 2 + 48 * union / 2 * expert_bytes(cfg))
    assert decode_weight_bytes(cfg, 64, 2) == pytest.approx(decode_weight_bytes(cfg, 64) / 2)
    # A measured count replaces the expectation.
    assert decode_weight_bytes(cfg, 64, routed=100) == non_expert + 48 * 100 * expert_bytes(cfg)


def test_our_model_holds_the_bytes_the_roofline_counts():
    """The model our loader builds of the shape, cut to two layers of 8 experts and a small
    vocabulary (its parameters left uninitialized), holds resident_weight_bytes plus the
    embedding."""
    shape = {**QWEN3_30B_A3B, "num_hidden_layers": 2, "num_experts": 8, "vocab_size": 1024}
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(ModelConfig.from_dict(shape), 4096)
    finally:
        torch.set_default_dtype(torch.float32)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == resident_weight_bytes(shape) + 1024 * 2048 * 2


def test_dense_shapes_keep_their_bytes():
    """Llama's weights per decode step as before the MoE terms: the closed form of its
    layers (FP8 linear layers with per-channel scales too)."""
    for name in ("llama-3.1-8b", "llama-3.1-70b", "tiny-llama"):
        c = SHAPES[name]
        h, i, v, heads, kv = (c["hidden_size"], c["intermediate_size"], c["vocab_size"],
                              c["num_attention_heads"], c["num_key_value_heads"])
        d = h // heads
        linear = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i
        outputs = (heads + 2 * kv) * d + h + 2 * i + h
        for li in (None, 1):
            layer = linear * (li or 2) + (4 * outputs if li else 0) + 2 * h * 2
            want = c["num_hidden_layers"] * layer + (v * h + h) * 2
            assert params_bytes(c, 2, li) == want
            assert decode_weight_bytes(c, 64, 2, linear_itemsize=li) == want / 2
        assert kv_bytes_per_token(c) == 2 * c["num_hidden_layers"] * kv * d * 2


def test_dummy_dir_is_read_by_our_loader_and_by_transformers():
    import transformers

    path = dummy_model_dir("qwen3-30b-a3b")
    ours = ModelConfig.from_dir(path)
    assert (ours.architecture, ours.num_layers, ours.hidden_size, ours.head_dim) == (
        "Qwen3MoeForCausalLM", 48, 2048, 128)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (128, 8, 768)
    assert ours.norm_topk_prob and ours.qk_norm and not ours.has_dense_layers
    assert (ours.num_heads, ours.num_kv_heads, ours.vocab_size) == (32, 4, 151936)
    assert ours.rope_theta == 1e6 and ours.rope_scaling is None
    assert not ours.tie_word_embeddings
    theirs = transformers.AutoConfig.from_pretrained(path)
    assert isinstance(theirs, transformers.Qwen3MoeConfig)
    assert (theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
            theirs.head_dim, theirs.num_hidden_layers) == (128, 8, 768, 128, 48)
    assert theirs.norm_topk_prob and not theirs.tie_word_embeddings
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
    assert rope["rope_theta"] == 1e6


def test_routed_experts_counts_each_steps_distinct_experts(tiny_model_root, monkeypatch):
    """A tiny Qwen3-MoE (4 experts, top 2, layers 0 and 2 sparse) built counting: forwards
    of chosen batches through its sparse layers, and RoutedExperts's means against the
    routers' own choices, in all and per rank of two holding experts 0-1 and 2-3."""
    monkeypatch.setenv(COUNT_ROUTED, "1")
    model_dir = make_tiny_model("qwen3_moe", tiny_model_root)
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), 64, torch.float32,
                       torch.device("cpu"), "dummy", seed=0)
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(layers) == 2
    # Counters, not weights: no checkpoint holds them.
    assert not any(name.endswith(".routed") for name in model.state_dict())
    gen = torch.Generator().manual_seed(0)
    unions, busiest = [], []
    with torch.no_grad():
        layers[0](torch.randn(5, 64, generator=gen))     # before: not counted
        with RoutedExperts(model, ranks=2) as routed:
            for tokens in (1, 3, 8):
                for moe in layers:
                    x = torch.randn(tokens, 64, generator=gen)
                    chosen = set(moe.gate(x)[1].flatten().tolist())
                    moe(x)
                    unions.append(len(chosen))
                    busiest.append(max(len(chosen & {0, 1}), len(chosen & {2, 3})))
    assert routed.forwards == 3
    assert routed.union == pytest.approx(sum(unions) / 6)
    assert routed.per_gpu == pytest.approx(sum(busiest) / 6)
    assert 2 <= routed.union <= 4


def test_runs_are_named_by_size_and_expert_parallelism():
    assert label({"tp": 2}) == "2"
    assert label({"tp": 2, "expert_parallel": True}) == "ep2"
    assert label({"tp": 1, "expert_parallel": False}) == "1"


def test_routed_experts_without_counters_measures_nothing(tiny_model_root, monkeypatch):
    """A model built without COUNT_ROUTED has no counters (tp_bench --no-count-experts):
    RoutedExperts leaves every field None, and the roofline takes the expectation."""
    monkeypatch.delenv(COUNT_ROUTED, raising=False)
    model_dir = make_tiny_model("qwen3_moe", tiny_model_root)
    model = load_model(model_dir, ModelConfig.from_dir(model_dir), 64, torch.float32,
                       torch.device("cpu"), "dummy", seed=0)
    moe = next(m for m in model.modules() if isinstance(m, SparseMoE))
    assert moe.routed is None
    with torch.no_grad(), RoutedExperts(model, ranks=1) as routed:
        moe(torch.randn(3, 64))
    assert routed.union is routed.per_gpu is routed.forwards is None
