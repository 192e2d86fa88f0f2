"""Dynamic per-token FP8 (e4m3) quantization of activations, the input of the FP8 GEMMs.

    x      [T, K]   bf16, fp16 or fp32; unit stride on K (any row stride)
    xq     [T, K]   float8_e4m3fn, contiguous: x / scale, rounded to nearest even, within
                    +-448 (e4m3's largest finite value)
    scale  [T, 1]   float32, contiguous: max(amax(|x[t, :]|) / 448, MIN_SCALE)

so x[t] ~ xq[t] * scale[t], and each row uses e4m3's whole range. MIN_SCALE keeps a row of
zeros (or of tiny values) from dividing by zero; vLLM clamps the same way.

One program per row. A row of up to ONE_PASS_MAX elements is loaded once, whole (a decode
batch has few rows, so each program's latency is the kernel's); a longer one is read twice,
BLOCK at a time: a pass for its amax, then one to divide and cast. Both divisions are IEEE-
rounded (tl.div_rn), so xq and scale are bit for bit those of torch's `per_token_quant_ref`
(kernels/fp8_math.py, which also holds the constants). Triton casts to e4m3 (float8e4nv) on
sm89+ GPUs only; the callers (pd_cluster/models/fp8.py) use torch elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import fp8_math
from kernels.fp8_math import FP8
from kernels.pdl import pdl_args, wait_for_inputs

FP8_MAX = tl.constexpr(fp8_math.FP8_MAX)        # the kernels' copies, as Triton reads them
MIN_SCALE = tl.constexpr(fp8_math.MIN_SCALE)
ONE_PASS_MAX = 16384        # longest row loaded whole (Llama-3-8B's MLP rows: 14336)
BLOCK = 8192                # the two-pass loop's chunk (16 warps)


@triton.jit
def quantize_row(x):
    """One whole row x [BLOCK] float32 (masked lanes 0) -> (xq [BLOCK] e4m3, scale): the
    kernel below's one-pass math, for kernels that quantize the row they produce."""
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _per_token_quant_kernel(X, XQ, Scale, K, stride_x, stride_q, BLOCK: tl.constexpr,
                            ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, q_row = X + row * stride_x, XQ + row * stride_q
    if ONE_PASS:            # BLOCK >= K: the whole row in registers
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
        tl.store(Scale + row, scale)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + offs, q.to(XQ.dtype.element_ty), mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(Scale + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + k0 + offs, q.to(XQ.dtype.element_ty), mask=mask)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, 1] float32): the module docstring's."""
    assert x.dim() == 2 and x.stride(-1) == 1
    t, k = x.shape
    xq = torch.empty(t, k, dtype=FP8, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t > 0:
        # Tiles measured on an H100 (graphed, M = 1 / 64 / 2048): loading the row whole with
        # block // 1024 warps (4 to 16) took 5.8-6.4 / 6.6-7.2 / 15-16 us at K = 4096 and
        # 8.8 / 9.6 / 53 us at K = 14336, against 15 / 16 / 59 us for 1024-element passes;
        # K = 28672 in 8192-element passes with 16 warps 12.5 / 13.5 / 85 us (34 / 35 / 112 us
        # in 1024-element ones with 2 warps).
        one_pass = k <= ONE_PASS_MAX
        block = triton.next_power_of_2(max(k, 1)) if one_pass else BLOCK
        _per_token_quant_kernel[(t,)](x, xq, scale, k, x.stride(0), xq.stride(0),
                                      BLOCK=block, ONE_PASS=one_pass,
                                      num_warps=min(16, max(4, block // 1024)),
                                      **pdl_args(x.device))
    return xq, scale
