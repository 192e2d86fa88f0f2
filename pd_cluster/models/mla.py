"""DeepSeek's multi-head latent attention layer: its projections, around
pd_cluster/attention/mla.py's attention over the latent KV cache.

    q        = q_proj(x)                          (q_lora_rank None: V2-Lite)
             | q_b_proj(norm(q_a_proj(x)))       [T, H, N + R] -> q_nope [.., N], q_pe [.., R]
    c, k_pe  = kv_a_proj_with_mqa(x)              [T, L + R]; c normalised, k_pe rotated
    o        = attend(q, cached [c, k_pe])        [T, H, V] (kv_b_proj's W_UK and W_UV inside)
    out      = o_proj(o)

RoPE runs here, on q_pe and k_pe only (DeepSeek's decoupled RoPE), with the norm of c and the
store (`_write_latent`: one kernel on the Triton backend, kernels/mla_rope_store.py): the
Llama backends' fused rope-and-store does not apply to a latent entry.

Tensor parallel: query heads split over the ranks (q_proj / q_b_proj, kv_b_proj by whole
heads; o_proj row-parallel, its partial sum reduced by the next norm); q_a_proj and
kv_a_proj_with_mqa are replicated, so every rank computes and caches the whole latent
(pd_cluster/kv_layout.py: a latent cache is replicated).
"""
from __future__ import annotations

import torch
from torch import nn

from pd_cluster.attention.mla import mla_attention
from pd_cluster.config import ModelConfig
from pd_cluster.distributed import get_tp
from pd_cluster.forward_context import ForwardContext
from pd_cluster.models import ops
from pd_cluster.models.deepseek_rope import DeepseekRotary
from pd_cluster.models.layers import RMSNorm
from pd_cluster.models.parallel import ColumnParallelLinear, RowParallelLinear, _parameter

# DeepSeek's q_a_layernorm and kv_a_layernorm keep the default epsilon, not rms_norm_eps.
LORA_NORM_EPS = 1e-6


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b), the whole layer on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = _parameter((out_features, in_features), (out_features, in_features))
        self.bias = _parameter((out_features,), (out_features,)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        m, hidden = cfg.mla, cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads // get_tp().size      # this rank's
        self.num_kv_heads = 1       # the cache's one latent entry, whole on every rank
        self.nope, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.latent = m.kv_lora_rank
        q_out = cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, m.cache_width, cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank,
                                              cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                              bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, hidden, bias=cfg.qkv_bias,
                                        reduce_results=False)
        self.scale = m.softmax_scale

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as W_UK [H, N, L] and W_UV [H, V, L] (views, this rank's
        heads)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        return w[:, :self.nope], w[:, self.nope:]

    def _write_latent(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                      rope: DeepseekRotary, cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kernel: bool) -> None:
        """q [T, H, N + R] gets its q_pe rotated in place; kv [T, L + R] becomes each new
        token's cache entry [kv_a_layernorm(c), rotated k_pe] at its slot. `kernel`:
        kernels/mla_rope_store.py does it all in one launch and skips the negative slots of
        CUDA graphs' padding rows (eager steps have none)."""
        if kernel:
            from kernels.mla_rope_store import mla_rope_store as write
        else:
            from kernels.reference import mla_rope_store_ref as write
        norm = self.kv_a_layernorm
        write(q, kv, norm.weight, norm.eps, positions, rope.cos, rope.sin, rope.interleave,
              cache, slot_mapping)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: DeepseekRotary,
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> this rank's part of o_proj's output [T, hidden]."""
        t = x.shape[0]
        q = self._queries(x).view(t, self.num_heads, self.nope + self.rope_dim)
        cache = ctx.kv_cache[self.layer_idx, 0].squeeze(-2)     # [blocks, block_size, L + R]
        # The Triton backend runs kernels/mla_rope_store.py and mla_decode.py (on a CPU: the
        # interpreter).
        kernel = ctx.backend.name == "triton"
        self._write_latent(q, self.kv_a_proj_with_mqa(x), positions, rope, cache,
                           ctx.attn.slot_mapping, kernel)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        w_uk, w_uv = self.absorbed_weights()
        o = mla_attention(q_nope, q_pe, cache, ctx.attn, w_uk, w_uv, self.scale, kernel)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))
