"""The Llama family in one module: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm),
and its mixture-of-experts members, Qwen3-MoE and Mixtral, whose sparse layers take
`pd_cluster.models.moe.SparseMoE` for the gated MLP.

Tokens of all sequences of a step are flattened into one [T] batch; attention metadata and
the KV cache travel in the ForwardContext. q/k/v and gate/up are packed into single matmuls;
`load_weights` slices Hugging Face's separate tensors into them.

Tensor parallel: the layers split themselves over `get_tp()`'s ranks when built
(`pd_cluster.models.parallel`); each rank holds num_heads / tp query heads and its share of
the KV heads (`kv_head_shard`), and its attention backend and KV cache see only those.
Every rank returns the same hidden states and full-vocabulary logits. Experts split by their
intermediate dimension, or whole over the ranks with `expert_parallel` (moe.py).

FP8 (`cfg.quantization == "fp8"`): the q/k/v, o, gate/up and down projections hold FP8
weights (`pd_cluster.models.parallel`), from an FP8 checkpoint or quantized at load from a
16-bit one; the embedding, lm_head and norms stay in the model dtype.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from kernels.fp8_math import FP8
from pd_cluster.config import ModelConfig
from pd_cluster.distributed import check_tp, get_tp
from pd_cluster.forward_context import ForwardContext
from pd_cluster.models.fp8 import Fp8Activation
from pd_cluster.models.layers import CausalLM, GatedMLP, RMSNorm, RotaryEmbedding
from pd_cluster.models.moe import SparseMoE, map_expert_name
from pd_cluster.models.parallel import (ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                        VocabParallelEmbedding, default_weight_loader)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.qkv_bias,
                                          quantization=cfg.quantization)
        # This rank's heads (all of them at tp = 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        # Its sum over the ranks is the post-attention norm's (RMSNorm reduce_input).
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False,
                                        quantization=cfg.quantization, reduce_results=False)
        # Per head, so the split over ranks leaves them whole.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: this rank's part of o_proj's output (the
        post-attention norm sums the ranks')."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kv = ctx.kv_cache[self.layer_idx]
        # An FP8 o projection over an fp8 cache takes the attention's own e4m3 output.
        o = ctx.backend.forward(q, k, v, positions, rope, kv[0], kv[1], ctx.attn, self.scale,
                                fp8_out=self.o_proj.fp8)
        return self.o_proj(o if isinstance(o, Fp8Activation) else o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        # Either returns this rank's partial sum, which the next norm reduces.
        self.mlp = SparseMoE(cfg, expert_parallel) if cfg.is_moe_layer(layer_idx) else \
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.quantization,
                     reduce_results=False)
        # FP8 projections read the norms' outputs quantized by the norm kernels themselves.
        # Under tensor parallelism the norms sum the row-parallel layers' partial outputs
        # (o_proj's, and down_proj's of the layer before) with their residual add.
        fp8 = cfg.quantization == "fp8"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, quantize=fp8,
                                       reduce_input=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, quantize=fp8,
                                                reduce_input=True)

    def forward(self, x, residual, positions, rope, ctx):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    # HF name fragment -> (our packed parameter, shard index)
    PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # An FP8 checkpoint's KV cache scales, per layer: self_attn.k_scale / v_scale (kv_scale:
    # one for both, older AutoFP8 files), or compressed-tensors' k_proj / v_proj.output_scale.
    KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v|kv)_scale|"
                          r"(k|v)_proj\.output_scale)$")

    def __init__(self, cfg: ModelConfig, max_positions: int, expert_parallel: bool = False):
        """`expert_parallel`: a MoE model's experts whole over the tensor-parallel ranks
        (EngineConfig.enable_expert_parallel), not sliced."""
        super().__init__()
        self.cfg = cfg
        if get_tp().size > 1:
            check_tp(cfg, get_tp().size, expert_parallel)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, expert_parallel)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, reduce_input=True)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:     # same vocabulary split, so the same rows on each rank
            self.lm_head.weight = self.embed_tokens.weight
        # The checkpoint's KV cache scales (load_weights): per layer (k_scale, v_scale), the
        # factors that turn FP8 K and V back into values (k ~ k8 * k_scale), or None for a
        # layer without both; None when the checkpoint has none (and for dummy weights).
        self.kv_scales: list[tuple[float, float] | None] | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (this rank's slice of each); raises if a model parameter
        is left unset. KV cache scales go to `self.kv_scales`; static activation scales
        (`input_scale`) are skipped: FP8 layers scale activations per token, dynamically."""
        params = dict(self.named_parameters())
        unset = set(params)
        if self.cfg.tie_word_embeddings:
            unset.discard("lm_head.weight")
        kv: dict[int, dict[str, float]] = {}
        for name, tensor in weights:
            if (match := self.KV_SCALE.search(name)) is not None:
                # Per tensor; a per-head scale's largest is one no head's values overflow.
                scale = tensor.float().max().item()
                which = match.group(2) or match.group(3)        # "k", "v" or "kv" (both)
                for part in which:
                    kv.setdefault(int(match.group(1)), {})[part] = scale
                continue
            target, shard = self._map_name(name)
            if target is None or target not in params:
                continue
            param = params[target]
            if tensor.dtype == FP8 and param.dtype != FP8:
                raise ValueError(f"checkpoint tensor {name} is FP8 but {target} is not an FP8 "
                                 f"layer's weight (the embedding, lm_head and norms stay "
                                 f"16-bit; FP8 layers need quantization fp8)")
            with torch.no_grad():
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
            unset.discard(target)
            if tensor.dtype != FP8 and f"{target}_scale" in params:
                unset.discard(f"{target}_scale")    # quantized at load: its loader set them
        if unset:
            raise ValueError(f"checkpoint lacks weights for: {sorted(unset)[:5]}")
        if kv:
            self.kv_scales = [(kv[i]["k"], kv[i]["v"]) if {"k", "v"} <= kv.get(i, {}).keys()
                              else None for i in range(self.cfg.num_layers)]

    def _map_name(self, name: str) -> tuple[str | None, object]:
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None, None
        name = name.removeprefix("model.")
        if self.cfg.num_experts and (expert := map_expert_name(name)) is not None:
            return expert
        for hf, (ours, shard) in self.PACKED.items():
            if f".{hf}." in name:
                return name.replace(hf, ours), shard
        return name, None
