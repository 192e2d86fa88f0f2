"""Tiny random DeepSeek-V2/V3 checkpoints, saved with transformers: multi-head latent
attention with and without q-LoRA, YaRN RoPE, a dense first layer, then MoE layers of 8
experts (top 2) with a shared expert and each routing method."""
from __future__ import annotations

import os
import zlib

import torch

from tests.support.tiny_models import VOCAB

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
         "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
         "mscale": 0.707, "mscale_all_dim": 1.0}

# name -> (config class, model class, extra config)
DEEPSEEK = {
    # V2-Lite's shape: no q-LoRA, greedy softmax routing.
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(q_lora_rank=None, topk_method="greedy")),
    # V2's: q-LoRA, group-limited routing (4 groups, the best 2 compete), scaled weights.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, routed_scaling_factor=2.0, rope_parameters=_YARN)),
    # V3's: q-LoRA, sigmoid routing with a correction bias, YaRN (mscale in the softmax).
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5, rope_parameters=_YARN)),
    # V3 without q-LoRA, RoPE on halves, one group.
    "deepseek_v3_halves": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                           dict(q_lora_rank=None, n_group=1, topk_group=1,
                                rope_interleave=False)),
}


def make_tiny_deepseek(family: str, root: str) -> str:
    """Save a random tiny DeepSeek model of `family` under `root` (once); its directory."""
    import transformers

    path = os.path.join(root, family)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg_cls, model_cls, extra = DEEPSEEK[family]
    config = getattr(transformers, cfg_cls)(**{**_COMMON, **extra})
    torch.manual_seed(zlib.crc32(family.encode()) % 1000)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():       # a bias that moves V3's choice (it starts at zero)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.05)
    model.save_pretrained(path)
    return path
