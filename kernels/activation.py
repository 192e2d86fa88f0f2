"""SiLU-and-multiply for gated MLPs (Llama's act_fn(gate_proj(x)) * up_proj(x)).

    gate_up [T, 2 * I] = [gate | up]  ->  out [T, I] = silu(gate) * up

silu is rounded to the input dtype before the product, as HF computes it in the model dtype.

With `quantize` (an FP8 down projection reads the result) each row is quantized per token as
it is written, exactly as kernels/fp8_quant.py would quantize `out`: out [T, I] e4m3 and
scale [T, 1] float32. That needs the whole row in one program, so I <= QUANT_MAX_INTER.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_math import FP8
from kernels.fp8_quant import quantize_row
from kernels.pdl import pdl_args, wait_for_inputs

BLOCK = 1024
QUANT_MAX_INTER = 16384     # Llama-3-8B's 14336 per rank; larger rows are not fused


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, Scale, stride_g, stride_o, INTER: tl.constexpr,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + INTER + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(GateUp.dtype.element_ty)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(GateUp.dtype.element_ty)
    if QUANT:       # BLOCK covers the row: one program per row
        out, scale = quantize_row(out.to(tl.float32))
        tl.store(Scale + row, scale)
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, quantize: bool = False, num_warps: int | None = None):
    """silu(gate) * up for gate_up [T, 2 * I]: a new [T, I] tensor, or with `quantize`
    (out [T, I] e4m3, scale [T, 1] float32). num_warps (a tuning knob) defaults to the
    launcher's choice."""
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1
    assert not quantize or inter <= QUANT_MAX_INTER, f"rows of {inter} are too long to fuse"
    out = torch.empty(num_tokens, inter, dtype=FP8 if quantize else gate_up.dtype,
                      device=gate_up.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=gate_up.device) \
        if quantize else None
    if num_tokens > 0:
        block = triton.next_power_of_2(inter) if quantize else BLOCK
        grid = (num_tokens, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](gate_up, out, out if scale is None else scale,
                                   gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block,
                                   QUANT=quantize, **pdl_args(gate_up.device),
                                   num_warps=num_warps or (min(16, max(4, block // 1024))
                                                           if quantize else 4))
    return out if scale is None else (out, scale)
