"""DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent
attention (pd_cluster/models/mla.py) over a latent KV cache, and mixture-of-experts layers
with shared experts and grouped routing (pd_cluster/models/deepseek_moe.py) after
`first_k_dense_replace` dense ones. The two differ in their config only: V3 routes with
sigmoid scores and a correction bias (noaux_tc), V2 with softmax (greedy or
group_limited_greedy), and V3 may rotate halves instead of interleaved pairs.

The decoder layer, norms, embedding and lm_head are the Llama family's (pre-norm, the
row-parallel layers' partial sums reduced by the next norm), so tensor parallelism splits
attention heads, dense MLPs and experts as there.

Checkpoints: the published per-expert names (`mlp.experts.{e}.gate_proj.weight`) or
transformers v5's fused experts; multi-token-prediction layers (V3's `layers.61`) are
skipped. FP8 block-quantized checkpoints are refused when the config is read
(pd_cluster/config.py checkpoint_quantization).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pd_cluster.config import ModelConfig
from pd_cluster.distributed import check_tp, get_tp
from pd_cluster.models.deepseek_moe import DeepseekMoE
from pd_cluster.models.deepseek_rope import DeepseekRotary
from pd_cluster.models.layers import CausalLM, GatedMLP, RMSNorm
from pd_cluster.models.mla import MLAttention
from pd_cluster.models.moe import map_expert_name
from pd_cluster.models.parallel import (ParallelLMHead, VocabParallelEmbedding,
                                        default_weight_loader)

_LAYER = re.compile(r"^layers\.(\d+)\.")
# Dense MLPs' (and shared experts') gate and up go into one packed matmul.
_PACKED = {"gate_proj": 0, "up_proj": 1}


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx)
        self.mlp = DeepseekMoE(cfg, expert_parallel) if cfg.is_moe_layer(layer_idx) else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, reduce_results=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, reduce_input=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                reduce_input=True)

    def forward(self, x, residual, positions, rope, ctx):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekForCausalLM(CausalLM):
    """Both DeepSeek architectures (module docstring); the Llama model's interface:
    forward, compute_logits, load_weights, kv_scales (always None: no fp8 latent cache)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, expert_parallel: bool = False):
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} is not a DeepSeek model")
        self.cfg = cfg
        if get_tp().size > 1:
            check_tp(cfg, get_tp().size, expert_parallel)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, expert_parallel)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, reduce_input=True)
        self.rope = DeepseekRotary(cfg.mla.qk_rope_head_dim, max_positions, cfg.rope_theta,
                                   cfg.rope_scaling, cfg.mla.rope_interleave)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_scales = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (this rank's slice of each); raises if a parameter is
        left unset."""
        params = dict(self.named_parameters())
        unset = set(params)
        if self.cfg.tie_word_embeddings:
            unset.discard("lm_head.weight")
        for name, tensor in weights:
            target, shard = self._map_name(name)
            if target is None or target not in params:
                continue
            if tensor.dtype.itemsize == 1:
                raise ValueError(f"checkpoint tensor {name} is {tensor.dtype}: quantized "
                                 f"DeepSeek checkpoints are not supported (a 16-bit one is)")
            with torch.no_grad():
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
            unset.discard(target)
        if unset:
            raise ValueError(f"checkpoint lacks weights for: {sorted(unset)[:5]}")

    def _map_name(self, name: str) -> tuple[str | None, object]:
        name = name.removeprefix("model.")
        layer = _LAYER.match(name)
        if "rotary_emb" in name or (layer and int(layer.group(1)) >= self.cfg.num_layers):
            return None, None       # V3's multi-token-prediction layers: not served here
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None, None
        if ".experts." in name and (expert := map_expert_name(name)) is not None:
            return expert
        for hf, shard in _PACKED.items():
            if f".{hf}." in name and ".self_attn." not in name:
                return name.replace(hf, "gate_up_proj"), shard
        return name, None
