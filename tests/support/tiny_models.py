"""Tiny random Hugging Face checkpoints of each supported family, saved with transformers,
and prompts of mixed lengths for them."""
from __future__ import annotations

import os
import random
import zlib

import torch

VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2)

# name -> (config class, model class, extra config)
FAMILIES = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(num_key_value_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64})),
    "qwen2_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "qwen3_qknorm": ("Qwen3Config", "Qwen3ForCausalLM",
                     dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=3)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1,
                                                             sliding_window=None)),
    # Tensor parallelism's awkward shapes: a vocabulary no rank count divides (padded), tied
    # to the embedding, and one KV head (replicated on every rank).
    "llama_odd_vocab": ("LlamaConfig", "LlamaForCausalLM",
                        dict(vocab_size=VOCAB - 3, num_key_value_heads=1,
                             tie_word_embeddings=True)),
    # Mixtures of experts: 4 experts, top 2. Qwen3-MoE renormalises the top 2 and its layer 1
    # is dense (mlp_only_layers); Mixtral's every layer is sparse.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_key_value_heads=2, head_dim=32, num_hidden_layers=3, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=None)),
}


def make_tiny_model(family: str, root: str, **overrides) -> str:
    """Save a random tiny model of `family` under `root` (once) and return its directory.
    `overrides`: config fields changed from the family's (e.g. a small initializer_range gives
    a model that falls into loops, which speculative decoding's tests want)."""
    import transformers

    path = os.path.join(root, "-".join([family] + [f"{k}={v}" for k, v in sorted(overrides.items())]))
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**_COMMON, **extra, **overrides})
    # crc32, not hash(): str hashes change with every process, and so would the model.
    torch.manual_seed(zlib.crc32(family.encode()) % 1000)
    model = getattr(transformers, model_cls)(config)
    model.save_pretrained(path)
    return path


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths; several share a 13-token or 26-token prefix with another prompt."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731 (ids 0-2 special)
    shared, longer = rand(13), rand(13)
    return [shared + rand(9), rand(3), shared + longer + rand(5), rand(30), shared + rand(1),
            shared + longer + rand(11), rand(17), rand(1)]
