"""The DeepSeek decode roofline's bytes (bench/models.py) on the CPU: DeepSeek-V2-Lite's
published shape (per-expert bytes, latent KV bytes a token, its 15.7B parameters), its config
read by our loader and by transformers, and the non-expert bytes of built tiny models (V2-Lite
and V3 layouts) counted from their parameters; DeepSeek's MoE layers count routed experts as
the Qwen3 ones do, so tp_bench's roofline measures them."""
from __future__ import annotations

import pytest
import torch

from bench.models import (DEEPSEEK_V2_LITE, SHAPES, decode_weight_bytes, dummy_model_dir,
                          expected_routed_experts, expert_bytes, kv_bytes_per_token, moe_layers,
                          num_experts, params_bytes, resident_weight_bytes)
from bench.tp_bench import RoutedExperts
from pd_cluster.config import ModelConfig
from pd_cluster.models.deepseek_moe import DeepseekMoE
from pd_cluster.models.loader import load_model
from pd_cluster.models.moe import COUNT_ROUTED, Experts

TINY_V3 = {**SHAPES["tiny-deepseek-v2"], "architectures": ["DeepseekV3ForCausalLM"],
           "model_type": "deepseek_v3", "q_lora_rank": 48, "topk_method": "noaux_tc",
           "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2, "norm_topk_prob": True}


def test_deepseek_v2_lite_bytes():
    cfg = DEEPSEEK_V2_LITE
    assert expert_bytes(cfg) == 3 * 2048 * 1408 * 2
    assert num_experts(cfg) == 64 and moe_layers(cfg) == 26
    assert kv_bytes_per_token(cfg) == 27 * (512 + 64) * 2
    attention = (2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048) * 2
    non_expert = (27 * (attention + 2 * 2048 * 2) + 3 * 2048 * 10944 * 2
                  + 26 * (64 * 2048 * 4 + 2 * expert_bytes(cfg)) + (102400 * 2048 + 2048) * 2)
    assert params_bytes(cfg) == non_expert
    # 15.7B parameters with the embedding (its fp32 router counted as two bf16 values).
    every = resident_weight_bytes(cfg) + 102400 * 2048 * 2
    assert 15.6e9 < (every - 26 * 64 * 2048 * 2) / 2 < 15.8e9
    union = expected_routed_experts(64, 6, 64)
    assert 63 < union < 64
    assert decode_weight_bytes(cfg, 64) == pytest.approx(non_expert
                                                         + 26 * union * expert_bytes(cfg))


def test_deepseek_v2_lite_config_reads_in_our_loader_and_in_transformers():
    path = dummy_model_dir("deepseek-v2-lite")
    ours = ModelConfig.from_dir(path)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (64, 6, 1408)
    assert ours.mla.kv_lora_rank == 512 and ours.mla.q_lora_rank is None
    assert ours.num_kv_heads == 1 and ours.head_dim == 576
    assert ours.routing.n_shared_experts == 2 and ours.mlp_only_layers == (0,)
    assert ours.mla.mscale == pytest.approx(0.0707 * torch.log(torch.tensor(40.0)).item() + 1)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoConfig.from_pretrained(path)
    assert isinstance(theirs, transformers.DeepseekV2Config)
    assert (theirs.kv_lora_rank, theirs.n_routed_experts, theirs.num_hidden_layers) == (512, 64, 27)


@pytest.mark.parametrize("shape", ["tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_non_expert_bytes_are_a_built_models(shape, tmp_path, monkeypatch):
    """params_bytes = a built bf16 model's parameter bytes less the routed experts and the
    embedding (V3: q-LoRA and the router's correction bias)."""
    cfg = TINY_V3 if shape == "tiny-deepseek-v3" else SHAPES[shape]
    monkeypatch.setattr("bench.models.SHAPES", {**SHAPES, shape: cfg})
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = dummy_model_dir(shape)
    model = load_model(path, ModelConfig.from_dir(path), 64, torch.bfloat16,
                       torch.device("cpu"), "dummy", seed=0)
    experts = sum(p.numel() * p.element_size() for m in model.modules()
                  if isinstance(m, Experts) for p in m.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.embed_tokens.weight
    assert experts == moe_layers(cfg) * num_experts(cfg) * expert_bytes(cfg)
    assert total - experts - embedding.numel() * embedding.element_size() == params_bytes(cfg)


def test_deepseek_moe_counts_its_routed_experts(tmp_path, monkeypatch):
    """Built with COUNT_ROUTED, each DeepSeek sparse layer counts the experts its router
    chose (bench/tp_bench.py RoutedExperts reads them)."""
    monkeypatch.setenv(COUNT_ROUTED, "1")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = dummy_model_dir("tiny-deepseek-v2")
    model = load_model(path, ModelConfig.from_dir(path), 64, torch.float32,
                       torch.device("cpu"), "dummy", seed=0)
    layers = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
    assert len(layers) == 1 and not any(n.endswith(".routed") for n in model.state_dict())
    gen = torch.Generator().manual_seed(0)
    unions = []
    with torch.no_grad(), RoutedExperts(model, ranks=1) as routed:
        for tokens in (1, 3, 8):
            x = torch.randn(tokens, 64, generator=gen)
            unions.append(len(set(layers[0].gate(x)[1].flatten().tolist())))
            layers[0](x)
    assert routed.forwards == 3 and routed.union == pytest.approx(sum(unions) / 3)
