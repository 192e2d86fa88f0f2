"""FP8 (e4m3) GEMM for decode-sized batches, W8A8 on the FP8 tensor cores: the weight
streamed once from memory, as kernels/linear.py streams a 16-bit one.

    xq       [M, K]  float8_e4m3fn, unit stride on K; x quantized per token (kernels/fp8_quant,
                     or fused into the RMSNorm / SiLU-and-mul that produced it)
    x_scale  [M, 1]  float32                          x ~ xq * x_scale (may be one scale
                     expanded over the rows: stride 0, as the attention's fp8 output has)
    w8       [N, K]  float8_e4m3fn, contiguous        w ~ w8 * w_scale[:, None]
    w_scale  [N]     float32, one scale per output row
    y        [M, N]  out_dtype: (xq @ w8.T) * x_scale * w_scale[None, :]

The math of per-token quant + `torch._scaled_mm` with row-wise scales. A decode step's GEMMs
are bound by the weight's bytes, and at small M cuBLAS's FP8 kernels stream them slowly on
an H100 (1.1-2.3 TB/s against a 3 TB/s copy; bench/fp8_gemm_bench.py), mostly because their
tiles leave SMs idle on the narrow shapes. The kernel is kernels/linear.py's, with the scales
applied to its float32 accumulator (SCALED); this module picks its tiles for FP8 and says
(`takes`) where it is used instead of cuBLAS.

Also measured and dropped: widening w8 to fp16 in registers for a 16-bit dot with x
unquantized (W8A16) was 1.3-2.1x slower than this at M = 64; quantizing x inside the GEMM
(every program re-reading and dividing all of x) was 5-10x slower.
"""
from __future__ import annotations

import functools

import torch
import triton

from kernels.fp8_math import FP8
from kernels.linear import _linear_kernel
from kernels.pdl import pdl_args

# The largest batch this kernel takes (`takes` says which shapes); above it the GEMMs turn
# compute-bound, and cuBLAS's tensor-core pipelines win.
MAX_ROWS = 256


def takes(m: int, n: int) -> bool:
    """Whether this kernel beats per-token quant + cuBLAS `_scaled_mm` at M rows and N output
    columns (bench/results/fp8_gemm_h100x1.json, 8B shapes on an H100, x pre-quantized in
    both): every shape at M <= 64 (qkv 13.7 against 16.8 us, o 10.8 / 14.8, gate_up
    46.7 / 50.6, down 26.1 / 39.5); at M = 128 all but gate_up (52.8 / 50.1); at M = 256 only
    o and down (13.2 / 15.0, 34.5 / 39.3), where N is small and cuBLAS's tiles leave SMs idle."""
    return m <= 64 or (m <= 128 and n < 16384) or (m <= MAX_ROWS and n <= 4096)


def tiles(m: int, n: int, k: int, h200: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages), the fastest measured for each 8B shape (`takes`'s
    source): wider tiles as M grows, narrow deep ones for long K, so every SM streams.

    An H200 (`h200`), with 1.4x an H100's bandwidth, wants deeper pipelines at M <= 128
    (bench/results/fp8_gemm_h200.json, fp8_gemm_stages_h200.json, us at M = 64: qkv 11.1
    against 11.5, o 9.0 / 9.2, gate_up 33.4 / 35.0, down 19.9 / 20.5; at 128: o 10.1 / 10.6,
    down 23.7 / 25.8); in the engine 0.7-1.0 % off the FP8 decode step at batch 64 and 128
    (bench/results/engine_knobs_tiles_h200_*.json). An H100 keeps its own: the gate_up tile
    is 0.6 % slower there, the deeper stages were never timed on it."""
    if h200 and m <= 64:
        if k >= 8192:
            return _long_k_h200_64(n)
        if n >= 16384:
            return 128, 128, 4
        return (64, 256, 5) if n >= 6000 else (32, 256, 6)
    if h200 and m <= 128:
        if k >= 8192:
            return (128, 256, 4) if n > 4096 else (64, 256, 5)
        return (128, 256, 4) if n >= 6000 else (64, 256, 5)
    if m <= 64:
        if k >= 8192:
            return 32, 512, 4
        if n >= 16384:
            return 64, 256, 3
        return (64, 256, 4) if n >= 6000 else (32, 512, 4)
    if m <= 128:
        if k >= 8192:
            return 64, 256, 4
        return (128, 256, 4) if n >= 6000 else (64, 256, 4)
    return 128, 256, 4


def _long_k_h200_64(n: int) -> tuple[int, int, int]:
    """An H200's tiles at M <= 64 for K >= 8192: the 8B down projection (N 4096) wants narrow
    deep ones; a 70B layer's wider N on a rank of two (qkv 5120, down 8192, gate_up 28672)
    streams faster with wider tiles (bench/results/fp8_gemm_70b_tp2_h200x2.json: qkv 15.6
    against 22.1 us, down 33.1 / 36.9, gate_up 64.9 / 79.0)."""
    if n <= 4096:
        return 32, 256, 8
    return (128, 256, 4) if n >= 16384 else (64, 256, 6)


@functools.lru_cache(maxsize=None)
def is_h200(device: torch.device) -> bool:
    """Whether `device` is an H200 (`tiles`)."""
    return device.type == "cuda" and "H200" in torch.cuda.get_device_name(device)


def fp8_linear_small(xq: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor,
                     w_scale: torch.Tensor, out_dtype: torch.dtype,
                     block_n: int | None = None, block_k: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None,
                     block_m: int | None = None) -> torch.Tensor:
    """y = (xq * x_scale) @ (w8 * w_scale[:, None]).T in out_dtype, the module docstring's;
    the tiles default to `tiles`, block_m to all rows up to 64 (rows per program)."""
    m, k = xq.shape
    n = w8.shape[0]
    assert xq.dtype == w8.dtype == FP8 and xq.stride(-1) == 1 and w8.is_contiguous()
    assert w8.shape[1] == k and x_scale.shape == (m, 1)
    default_n, default_k, default_stages = tiles(m, n, k, is_h200(xq.device))
    block_n, block_k = block_n or default_n, block_k or default_k
    block_m = block_m or max(16, min(64, triton.next_power_of_2(m)))
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _linear_kernel[grid](xq, w8, y, m, n, k, xq.stride(0), w8.stride(0), y.stride(0), x_scale,
                         x_scale.stride(0), w_scale, SCALED=True, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                         num_stages=num_stages or default_stages, **pdl_args(xq.device))
    return y


def fp8_linear_small_ref(xq: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor,
                         w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel's math in float32 by torch."""
    return ((xq.float() * x_scale) @ (w8.float() * w_scale[:, None]).t()).to(out_dtype)
