"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP (its linear
layers tensor-parallel: `pd_cluster.models.parallel`).

Each op has one torch implementation here; `pd_cluster.models.ops` swaps in fused Triton
kernels on GPU when they are importable.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pd_cluster.models import ops
from pd_cluster.models.parallel import MergedColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, quantize: bool = False, reduce_input: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.quantize = quantize    # an FP8 layer reads the output: hand it over quantized
        # x, when it comes with a residual, is a row-parallel layer's unreduced output.
        self.reduce_input = reduce_input

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x (after adding residual, if given). Returns x, or (x, new residual)."""
        if self.reduce_input and residual is not None:
            return ops.all_reduce_rms_norm(x, self.weight, self.eps, residual, self.quantize)
        return ops.rms_norm(x, self.weight, self.eps, residual, self.quantize)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, including Llama-3.1 and linear rope scaling (as HF computes them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed [max_pos, head_dim] cos/sin cache."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # The Triton backend's layout (kernels/rope.py): the non-duplicated halves of cos and
        # sin side by side. The backend applies it; forward() is the torch version.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D], positions: [T]; returns rotated (q, k), computed in
        the model dtype as HF does."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): gate and up column-parallel in one matmul, down
    row-parallel, so each rank's [T, intermediate / tp] activation never leaves it."""

    def __init__(self, hidden: int, intermediate: int, quantization: str | None = None,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       bias=False, quantization=quantization)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False,
                                           quantization=quantization,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (summed over the ranks, unless reduce_results=False)."""
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x), self.down_proj.fp8))


class CausalLM(nn.Module):
    """What every model's top module shares: the layer loop and the logits. A subclass builds
    `embed_tokens`, `layers` (each called as layer(x, residual, positions, rope, ctx) ->
    (x, residual)), `rope`, `norm` and `lm_head`."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]; `ctx` the step's
        ForwardContext."""
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rope, ctx)
            if ctx.on_layer_done is not None:
                ctx.on_layer_done(i)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 logits [S, vocab_size], the full vocabulary on every rank."""
        return self.lm_head.compute_logits(hidden).float()
