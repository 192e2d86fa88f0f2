"""SiLU-and-multiply for gated MLPs (Llama's act_fn(gate_proj(x)) * up_proj(x)).

    gate_up [T, 2 * I] = [gate | up]  ->  out [T, I] = silu(gate) * up

silu is rounded to the input dtype before the product, as HF computes it in the model dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(GateUp, Out, stride_g, stride_o, INTER: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + INTER + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(GateUp.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I]; returns a new [T, I] tensor."""
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens > 0:
        grid = (num_tokens, triton.cdiv(inter, BLOCK))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0),
                                   INTER=inter, BLOCK=BLOCK)
    return out
