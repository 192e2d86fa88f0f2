"""DeepSeek's decoupled RoPE: only the qk_rope_head_dim part of each query head and the one
shared k_pe are rotated, on interleaved pairs (V2; V3's rope_interleave) or on halves, with
YaRN's frequencies and attention factor as DeepSeek's configs give them."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels.reference import rotate_pairs
from pd_cluster.models.deepseek_config import yarn_mscale
from pd_cluster.models.layers import rope_inv_freq


def yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and the factor it scales cos and sin by (transformers'
    _compute_yarn_parameters): frequencies faster than beta_fast rotations over the original
    context kept, slower than beta_slow divided by `factor`, a linear ramp between."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001           # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp             # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = (1 / (factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep
    return inv_freq, float(attention)


class DeepseekRotary(nn.Module):
    """Rotates [..., R] vectors by their token's position: pairs (a_i, b_i) taken as
    (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + R/2]); the result is laid out
    [a' | b'] either way. Queries and keys are rotated alike, so for the interleaved form
    their dot products are those of DeepSeek's in-place pairs (the cached k_pe is stored in
    this layout)."""

    def __init__(self, dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, interleave: bool):
        super().__init__()
        self.interleave = interleave
        if (scaling or {}).get("rope_type") == "yarn":
            inv_freq, attention = yarn_inv_freq(dim, theta, scaling)
        else:
            inv_freq, attention = rope_inv_freq(dim, theta, scaling), 1.0
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * attention, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., R], positions [T] -> rotated x (computed in fp32, returned in x's
        dtype)."""
        return rotate_pairs(x, self.cos[positions], self.sin[positions], self.interleave)
