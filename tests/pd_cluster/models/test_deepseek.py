"""DeepSeek-V2/V3 (pd_cluster/models/deepseek.py): greedy output equals transformers token for
token through the engine with chunked prefill, prefix caching and preemption, for tiny V2 and
V3 configs (with and without q-LoRA, YaRN, a dense first layer, shared experts, each routing
method); the config's reading, the routing's choice, absorbed decode against expanded
attention, the checkpoint layouts, and the refusals."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd_cluster import LLM, SamplingParams
from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.attention.mla import decode_reference, prefill_expanded
from pd_cluster.config import ModelConfig
from pd_cluster.models.deepseek_config import GroupedRouting
from pd_cluster.models.deepseek_moe import grouped_topk
from tests.support.hf_reference import hf_greedy
from tests.support.tiny_deepseek import DEEPSEEK, make_tiny_deepseek
from tests.support.tiny_models import mixed_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(DEEPSEEK))
def test_greedy_matches_hf_with_chunking_prefix_sharing_and_preemption(family, tiny_model_root):
    model_dir = make_tiny_deepseek(family, tiny_model_root)
    prompts = mixed_prompts()
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # As tests/pd_cluster/test_engine_matches_hf.py: 4-token blocks and a 7-token budget chunk
    # every longer prompt; 40 blocks cannot hold all 8 sequences, so some are preempted.
    llm = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_batched_tokens=7)
    assert llm.engine.kv_layout.latent
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0, "the pool was meant to be too small"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks

    hits_before = stats.prefix_hits
    again = llm.generate(prompts[:3], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected[:3]
    assert stats.prefix_hits > hits_before
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_config_reads_latent_attention_routing_and_dense_layers(tiny_model_root):
    v3 = ModelConfig.from_dir(make_tiny_deepseek("deepseek_v3", tiny_model_root))
    m = v3.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim) == (48, 32, 16, 8, 16)
    # The latent cache: one "head" of L + R values, one part per layer.
    assert (v3.num_kv_heads, v3.head_dim, v3.kv_parts) == (1, 40, 1)
    assert v3.kv_bytes_per_token(2) == 3 * 40 * 2
    assert [v3.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert v3.routing == GroupedRouting("noaux_tc", 4, 2, 2.5, 1)
    # YaRN's mscale_all_dim enters the softmax scale squared.
    assert m.mscale > 1 and m.softmax_scale == pytest.approx(24 ** -0.5 * m.mscale ** 2)
    lite = ModelConfig.from_dir(make_tiny_deepseek("deepseek_v2_lite", tiny_model_root))
    assert lite.mla.q_lora_rank is None and lite.routing.method == "greedy"
    assert lite.mla.softmax_scale == 24 ** -0.5


def _deepseek_config(tiny_model_root, **changes) -> dict:
    with open(os.path.join(make_tiny_deepseek("deepseek_v3", tiny_model_root),
                           "config.json")) as f:
        return {**json.load(f), **changes}


def test_unsupported_configs_are_refused_with_a_reason(tiny_model_root):
    with pytest.raises(ValueError, match="topk_method 'random'"):
        ModelConfig.from_dict(_deepseek_config(tiny_model_root, topk_method="random"))
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        ModelConfig.from_dict(_deepseek_config(tiny_model_root, scoring_func="softmax"))
    block_fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="block-wise FP8 is not supported"):
        ModelConfig.from_dict(_deepseek_config(tiny_model_root, quantization_config=block_fp8))
    cfg = ModelConfig.from_dict(_deepseek_config(tiny_model_root))
    with pytest.raises(ValueError, match="FP8"):
        cfg.with_quantization("fp8")


def test_an_fp8_kv_cache_is_refused(tiny_model_root):
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 is not supported"):
        LLM(make_tiny_deepseek("deepseek_v2_lite", tiny_model_root), kv_cache_dtype="fp8")


def test_routing_keeps_to_the_chosen_groups():
    # 4 groups of 2: group 0 has the best single expert, group 1 the best pair, group 2 the
    # second-best single expert.
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.45, 0.6, 0.0, 0.1, 0.1]])

    def chosen(method: str, bias=None) -> set[int]:
        routing = GroupedRouting(method, n_group=4, topk_group=2, routed_scaling_factor=1.0,
                                 n_shared_experts=0)
        return set(grouped_topk(scores, bias, 2, routing)[0].tolist())

    assert chosen("greedy") == {0, 4}
    assert chosen("group_limited_greedy") == {0, 4}     # groups by their best: 0 and 2
    assert chosen("noaux_tc") == {0, 2}                  # groups by their best two: 1 and 0
    bias = torch.zeros(8)
    bias[7] = 1.0                     # group 3 now the best, group 1 the second
    assert chosen("noaux_tc", bias) == {2, 7}


def test_absorbed_decode_equals_expanded_attention():
    """The decode path (queries mapped into the latent space, one shared KV head, output
    mapped back) gives what expanding the latent into per-head K and V gives."""
    torch.manual_seed(0)
    heads, nope, rope, v_dim, latent, block_size, seq_len = 4, 16, 8, 12, 32, 4, 11
    cache = torch.zeros(6, block_size, latent + rope)
    table = torch.tensor([[5, 2, 0]], dtype=torch.int32)
    slots = torch.tensor([table[0, p // block_size] * block_size + p % block_size
                          for p in range(seq_len)])
    cache.view(-1, latent + rope)[slots] = torch.randn(seq_len, latent + rope)
    w_uk, w_uv = torch.randn(heads, nope, latent) * 0.2, torch.randn(heads, v_dim, latent) * 0.2
    q_nope, q_pe = torch.randn(1, heads, nope), torch.randn(1, heads, rope)
    meta = AttentionMetadata(slots[-1:], torch.tensor([0, 1]), torch.tensor([seq_len]), table,
                             1, 1, 1, seq_len, [0, 1], [seq_len])
    scale = (nope + rope) ** -0.5
    o_latent = decode_reference(torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe, cache, meta,
                                scale)
    absorbed = torch.einsum("thl,hvl->thv", o_latent, w_uv)
    expanded = prefill_expanded(q_nope, q_pe, cache, table[0], seq_len, w_uk, w_uv, scale)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


def test_fused_experts_and_extra_prediction_layers_load_alike(tiny_model_root, tmp_path):
    """transformers v5's fused expert tensors load as the per-expert ones do, and V3's
    multi-token-prediction layer (one past the last) is skipped."""
    src = make_tiny_deepseek("deepseek_v3", tiny_model_root)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
            for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"]
                                               for e in range(8)])
    fused["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    out = tmp_path / "fused"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(fused, str(out / "model.safetensors"))
    prompt = [[4, 8, 15, 16, 23, 42]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [LLM(d).generate(prompt, params)[0].outputs[0].token_ids for d in (src, str(out))]
    assert got[0] == got[1]


def test_dummy_weights_serve_from_a_config_alone(tiny_model_root, tmp_path):
    cfg_only = tmp_path / "cfg_only"
    os.makedirs(cfg_only)
    shutil.copy(os.path.join(make_tiny_deepseek("deepseek_v2", tiny_model_root), "config.json"),
                cfg_only / "config.json")
    llm = LLM(str(cfg_only), load_format="dummy")
    out = llm.generate([[4, 8, 15, 16]], SamplingParams(temperature=0, max_tokens=6,
                                                        ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
