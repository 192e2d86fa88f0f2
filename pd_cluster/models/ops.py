"""Ops of the models: torch versions, and Triton kernels on GPU.

`use_triton(True)` is called by the model runner when the Triton backend is selected; the
kernels then serve CUDA tensors and the torch code serves everything else.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_kernels = None  # the kernels modules, once enabled
_linear = None   # kernels.linear.Dispatch, once enabled


def use_triton(enabled: bool) -> None:
    global _kernels, _linear
    if not enabled:
        _kernels = _linear = None
        return
    from kernels import activation, linear, rmsnorm
    _kernels = (rmsnorm, activation)
    _linear = linear.Dispatch()


@contextlib.contextmanager
def choosing_gemm_kernels():
    """Within: each GEMM of a new small-batch shape times cuBLAS against the Triton kernel
    and keeps the faster (the CUDA-graph warm-up runs, before each capture). Outside, shapes
    never measured take cuBLAS, so serving never stops to time anything."""
    if _linear is None:
        yield
        return
    _linear.measuring = True
    try:
        yield
    finally:
        _linear.measuring = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _linear is not None and x.is_cuda:
        return _linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _fast(x: torch.Tensor) -> bool:
    return _kernels is not None and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """weight * rmsnorm(x [+ residual]); with a residual, returns (out, x + residual)."""
    if _fast(x) and x.is_contiguous():
        rmsnorm = _kernels[0]
        if residual is None:
            return rmsnorm.rms_norm(x, weight, eps)
        return rmsnorm.fused_add_rms_norm(x, residual, weight, eps)
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _fast(x):
        return _kernels[1].silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
