"""RMSNorm with an optional fused residual add, matching HF LlamaRMSNorm.

    x, residual  [..., hidden]          weight [hidden]
    residual_out = x + residual          (rounded to x.dtype, as HF adds in the model dtype)
    out          = weight * (r.float() * rsqrt(mean(r.float()^2) + eps)).to(x.dtype)

where r is residual_out (or x without a residual). One program normalises one row.

With `quantize` (the FP8 layers' input norms) the row is quantized per token as it is written,
exactly as kernels/fp8_quant.py would quantize `out`: xq [..., hidden] e4m3 and
scale [..., 1] float32 take out's place, and the GEMM that reads them launches no quant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_math import FP8
from kernels.fp8_quant import quantize_row
from kernels.pdl import pdl_args, wait_for_inputs


@triton.jit
def normalize_row(x, Weight, offs, mask, eps, HIDDEN: tl.constexpr):
    """One row x [BLOCK] in the model dtype (masked lanes 0) -> weight * rmsnorm(x) in that
    dtype, rounded where HF rounds (kernels/peer_all_reduce.py's fused norm shares it)."""
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(x.dtype)
    weight = tl.load(Weight + offs, mask=mask, other=0.0)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def store_normalized_row(x, Weight, OutRow, ScaleRow, offs, mask, eps, HIDDEN: tl.constexpr,
                         QUANT: tl.constexpr):
    """Normalise row x and store it at OutRow (with QUANT: e4m3, its scale at ScaleRow)."""
    out = normalize_row(x, Weight, offs, mask, eps, HIDDEN)
    if QUANT:
        out, scale = quantize_row(out.to(tl.float32))
        tl.store(ScaleRow, scale)
    tl.store(OutRow + offs, out.to(OutRow.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    X, Residual, ResidualOut, Weight, Out, Scale, eps,
    stride_x, stride_r, stride_ro, stride_o,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    store_normalized_row(x, Weight, Out + row * stride_o, Scale + row, offs, mask, eps, HIDDEN,
                         QUANT)


def _launch(x: torch.Tensor, residual: torch.Tensor, residual_out: torch.Tensor,
            weight: torch.Tensor, out: torch.Tensor, eps: float, has_residual: bool,
            scale: torch.Tensor | None = None) -> None:
    hidden = x.shape[-1]
    x, residual, residual_out, out = (t.reshape(-1, hidden)
                                      for t in (x, residual, residual_out, out))
    assert x.stride(-1) == residual.stride(-1) == 1
    if x.shape[0] == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, residual_out, weight, out, weight if scale is None else scale, eps,
        x.stride(0), residual.stride(0), residual_out.stride(0), out.stride(0),
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual, QUANT=scale is not None,
        num_warps=min(max(block // 256, 1), 16), **pdl_args(x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False):
    """weight * rmsnorm(x): [..., hidden] -> [..., hidden] in x.dtype, or with `quantize`
    (xq [..., hidden] e4m3, scale [..., 1] float32)."""
    out, scale = _outputs(x, quantize)
    # Without a residual the kernel never touches the residual pointers; x stands in.
    _launch(x, x, x, weight, out, eps, has_residual=False, scale=scale)
    return out if scale is None else (out, scale)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quantize: bool = False):
    """(weight * rmsnorm(x + residual), x + residual), both [..., hidden] in x.dtype; with
    `quantize` ((xq, scale), x + residual) as `rms_norm` gives them."""
    out, scale = _outputs(x, quantize)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, new_residual, weight, out, eps, has_residual=True, scale=scale)
    return (out if scale is None else (out, scale)), new_residual


def _outputs(x: torch.Tensor, quantize: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = torch.empty(x.shape, dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = (torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
             if quantize else None)
    return out, scale
