"""Matmul for decode-sized batches: y = x @ w.T, the weight streamed once from memory.

    x  [M, K]   activations, M small (a decode batch), unit stride on K; bf16 or fp16 (the
                tiles are sized for 2-byte elements: fp32 ones would not fit shared memory)
    w  [N, K]   an nn.Linear weight, contiguous
    y  [M, N]   x's dtype

A decode step's GEMMs read every weight once and do little arithmetic per byte, so their
speed is the rate at which the weight streams in. Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)):
a program owns BLOCK_M rows and BLOCK_N output columns over all of K; its x rows come from
L2. Row tiles vary fastest, so the programs that share a weight tile run together and only
the first of them reads it from memory.

cuBLAS is faster on some shapes and slower on others (bench/gemm_bench.py on an H200 at
M = 64: this kernel 35 against 37 us for down and 268 against 285 for lm_head, level for
gate_up, slower for qkv and o), so `Dispatch` times both on the first call of each shape
and keeps the faster; only while `measuring` is set (the engine sets it for its CUDA-graph
warm-up runs, never inside a capture), and a shape never measured takes cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_args, wait_for_inputs

# Above this cuBLAS won every shape measured (bench/gemm_bench.py, H200, M = 128 and 256),
# so larger batches are not even timed.
MAX_ROWS = 64


@triton.jit
def _linear_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, XS, stride_xs, WS,
                   SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """SCALED: x and w are FP8 with per-row scales XS [M] (stride_xs apart: 0 for one scale
    shared by every row) and WS [N] (kernels/fp8_linear.py), applied once to the float32
    accumulator."""
    wait_for_inputs(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if SCALED:
        x_scale = tl.load(XS + offs_m * stride_xs, mask=mask_m, other=0.0)
        w_scale = tl.load(WS + offs_n, mask=mask_n, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tiles(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): long rows take narrow, deep tiles (more programs to stream K)."""
    return (32, 256) if k >= 8192 else (128, 128)


def linear(x: torch.Tensor, w: torch.Tensor, block_n: int | None = None,
           block_k: int | None = None, num_stages: int = 4) -> torch.Tensor:
    """x @ w.T (module docstring); the tile knobs default to `tiles(K)`."""
    m, k = x.shape
    n = w.shape[0]
    assert x.stride(-1) == 1 and w.is_contiguous() and w.shape[1] == k
    default_n, default_k = tiles(k)
    block_n, block_k = block_n or default_n, block_k or default_k
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # Unscaled: the scale pointers are never read; x stands in.
    _linear_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), x, 0, x,
                         SCALED=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         num_warps=4, num_stages=num_stages, **pdl_args(x.device))
    return y


class Dispatch:
    """x @ w.T (+ bias) by cuBLAS or `linear`, whichever measured faster for (M, N, K)."""

    def __init__(self, repeats: int = 20):
        self.repeats = repeats
        self.measuring = False
        self.choice: dict[tuple[int, int, int], bool] = {}   # shape -> use the Triton kernel

    def __call__(self, x: torch.Tensor, w: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if (m > MAX_ROWS or bias is not None or not x.is_contiguous()
                or x.dtype not in (torch.bfloat16, torch.float16)):
            return F.linear(x, w, bias)
        key = (m, w.shape[0], w.shape[1])
        use = self.choice.get(key)
        if use is None:
            if not self.measuring or torch.cuda.is_current_stream_capturing():
                return F.linear(x, w)
            use = self.choice[key] = self._time(linear, x, w) < self._time(F.linear, x, w)
        return linear(x, w) if use else F.linear(x, w)

    def _time(self, fn, x: torch.Tensor, w: torch.Tensor) -> float:
        fn(x, w)                                # compile / pick an algorithm first
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.repeats):
            fn(x, w)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
