"""Elementwise ops of the models: torch versions, replaced by fused Triton kernels on GPU.

`use_triton(True)` is called by the model runner when the Triton backend is selected.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_triton = None  # the kernels package, once enabled


def use_triton(enabled: bool) -> None:
    global _triton
    if enabled:
        import kernels
        _triton = kernels
    else:
        _triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return out if residual is None else (out, residual)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor):
    cos_t = cos[positions].unsqueeze(1).to(q.dtype)
    sin_t = sin[positions].unsqueeze(1).to(q.dtype)
    return q * cos_t + _rotate_half(q) * sin_t, k * cos_t + _rotate_half(k) * sin_t


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
