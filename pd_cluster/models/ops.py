"""Ops of the models: torch versions, and Triton kernels on GPU.

`use_triton(True)` is called by the model runner when the Triton backend is selected; the
kernels then serve CUDA tensors and the torch code serves everything else.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_moe_ref
from kernels.reference import router_topk_ref
from pd_cluster.distributed import all_reduce, get_tp
from pd_cluster.models import fp8

_FUSED_NORM = os.environ.get("PD_CLUSTER_FUSED_NORM", "1") != "0"
_kernels = None  # the kernels modules, once enabled
_linear = None   # kernels.linear.Dispatch, once enabled


def use_triton(enabled: bool) -> None:
    global _kernels, _linear
    if not enabled:
        _kernels = _linear = None
        return
    from kernels import activation, fused_moe_triton, linear, moe_router, rmsnorm
    _kernels = (rmsnorm, activation, fused_moe_triton, moe_router)
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
             residual: torch.Tensor | None = None, quantize: bool = False):
    """weight * rmsnorm(x [+ residual]); with a residual, returns (out, x + residual). With
    `quantize` (an FP8 layer reads out) out is an `Fp8Activation`, quantized in the norm's
    own kernel on GPU."""
    if _fast(x) and x.is_contiguous() and (not quantize or fp8._fp8_gpu(x.device)):
        rmsnorm = _kernels[0]
        if residual is None:
            return _activation(rmsnorm.rms_norm(x, weight, eps, quantize), x.dtype)
        out, residual = rmsnorm.fused_add_rms_norm(x, residual, weight, eps, quantize)
        return _activation(out, x.dtype), residual
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    if quantize:
        out = fp8.Fp8Activation.of(out)
    return out if residual is None else (out, residual)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor, quantize: bool = False):
    """`rms_norm` of the sum over the tensor-parallel ranks of x (a row-parallel layer's
    partial output): one kernel for the all-reduce, residual add and norm where the peer
    all-reduce takes x (pd_cluster/peer_all_reduce.py), else the all-reduce, then the norm.
    PD_CLUSTER_FUSED_NORM=0 in the environment keeps them apart (for comparison)."""
    peer = get_tp().peer
    if (peer is not None and _FUSED_NORM and x.is_cuda and peer.fits_rows(x)
            and (not quantize or fp8._fp8_gpu(x.device))):
        out, residual = peer.add_rms_norm(x, residual, weight, eps, quantize)
        return _activation(out, x.dtype), residual
    return rms_norm(all_reduce(x), weight, eps, residual, quantize)


def silu_and_mul(x: torch.Tensor, quantize: bool = False):
    """silu(gate) * up of x = [gate | up]; with `quantize` an `Fp8Activation` (module
    docstring of kernels/activation.py)."""
    if _fast(x):
        activation = _kernels[1]
        if not quantize:
            return activation.silu_and_mul(x)
        if fp8._fp8_gpu(x.device) and x.shape[-1] // 2 <= activation.QUANT_MAX_INTER:
            return _activation(activation.silu_and_mul(x, quantize=True), x.dtype)
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return fp8.Fp8Activation.of(out) if quantize else out


def _activation(out, dtype: torch.dtype):
    """A quantizing kernel's (xq, scale) as an Fp8Activation; a plain tensor as it is."""
    return fp8.Fp8Activation(*out, dtype) if isinstance(out, tuple) else out


def router_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool,
                renormalize: bool, eps: float, scale: float, dtype: torch.dtype,
                sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router's (topk_weights in dtype, topk_ids) from its logits [T, E]
    (kernels/moe_router.py's contract): one kernel on a GPU, else the torch reference (whose
    `sorted` says which order of ids transformers' router gives)."""
    if _fast(logits) and logits.shape[-1] <= _kernels[3].MAX_EXPERTS:
        return _kernels[3].router_topk(logits, bias, top_k, sigmoid, renormalize, eps, scale,
                                       dtype)
    return router_topk_ref(logits, bias, top_k, sigmoid, renormalize, eps, scale, dtype,
                           sorted)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """A MoE layer's experts, kernels/fused_moe.py's contract: x [T, H] -> [T, H], the sum of
    each token's top-k experts (those this rank holds) weighted by the router. On a GPU the
    Triton kernel (sorted by expert, no host sync, so CUDA graphs capture it); elsewhere the
    torch reference, bit-exact with transformers' per-expert loop."""
    if _fast(x):
        return _kernels[2].fused_moe(x, w13, w2, topk_weights, topk_ids, first_expert)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, first_expert)
