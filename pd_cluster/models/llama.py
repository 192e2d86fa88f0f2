"""The Llama family in one module: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens of all sequences of a step are flattened into one [T] batch; attention metadata and
the KV cache travel in the ForwardContext. q/k/v and gate/up are packed into single matmuls;
`load_weights` slices Hugging Face's separate tensors into them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pd_cluster.config import ModelConfig
from pd_cluster.forward_context import ForwardContext
from pd_cluster.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kv = ctx.kv_cache[self.layer_idx]
        o = ctx.backend.forward(q, k, v, positions, rope, kv[0], kv[1], ctx.attn, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rope, ctx):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (our packed parameter, shard index)
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope, ctx)
            if ctx.on_layer_done is not None:
                ctx.on_layer_done(i)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raises if a model parameter is left unset."""
        params = dict(self.named_parameters())
        unset = set(params)
        if self.cfg.tie_word_embeddings:
            unset.discard("lm_head.weight")
        for name, tensor in weights:
            target, shard = self._map_name(name)
            if target is None or target not in params:
                continue
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    start, size = self._shard_range(target, shard)
                    param[start:start + size].copy_(tensor)
            unset.discard(target)
        if unset:
            raise ValueError(f"checkpoint lacks weights for: {sorted(unset)[:5]}")

    def _map_name(self, name: str) -> tuple[str | None, int | None]:
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None, None
        name = name.removeprefix("model.")
        for hf, (ours, shard) in self.PACKED.items():
            if f".{hf}." in name:
                return name.replace(hf, ours), shard
        return name, None

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        c = self.cfg
        if "qkv_proj" in target:
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        return shard * c.intermediate_size, c.intermediate_size
