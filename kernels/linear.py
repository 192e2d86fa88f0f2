"""Matmul for decode-sized batches: y = x @ w.T, the weight streamed once from memory.

    x  [M, K]   activations, M small (a decode batch: 1..256 rows), unit stride on K
    w  [N, K]   an nn.Linear weight, contiguous
    y  [M, N]   x's dtype

A decode step's GEMMs read every weight once and do little arithmetic per byte, so their
speed is the rate at which the weight streams in. Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M),
SPLIT_K): a program owns BLOCK_N output columns and one K range; its x rows come from L2.
With SPLIT_K > 1 the partial sums meet in an fp32 buffer by atomic adds and a second kernel
rounds them to y's dtype (the K ranges are few, so the sum is as exact as one pass's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _linear_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = (k0 + offs_k) < k_end
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


def linear(x: torch.Tensor, w: torch.Tensor, block_m: int = 64, block_n: int = 64,
           block_k: int = 128, split_k: int = 1, num_warps: int = 4,
           num_stages: int = 4) -> torch.Tensor:
    """x @ w.T (module docstring); the tile knobs are the caller's tuning choice."""
    m, k = x.shape
    n = w.shape[0]
    assert x.stride(-1) == 1 and w.is_contiguous() and w.shape[1] == k
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                num_warps=num_warps, num_stages=num_stages)
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        _linear_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), **meta)
        return y
    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    _linear_kernel[grid](x, w, acc, m, n, k, x.stride(0), w.stride(0), acc.stride(0), **meta)
    return acc.to(x.dtype)
