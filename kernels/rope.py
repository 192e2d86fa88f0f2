"""Rotary position embedding, neox style (HF rotate_half), applied in place.

    q              [T, num_heads, head_dim]       (any strides with unit head_dim stride)
    k              [T, num_kv_heads, head_dim]
    positions      [T] int
    cos_sin_cache  [max_pos, rotary_dim]: cos(pos * inv_freq) in the first rotary_dim / 2
                   columns, sin in the rest (fp32 recommended; rope scaling is baked in)

The first rotary_dim dims of each head are split in halves x1, x2 and become
(x1 * cos - x2 * sin, x2 * cos + x1 * sin), computed in fp32; dims past rotary_dim are kept.
One program rotates every head of one token, reading its cos/sin row once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the [NUM_HEADS, 2 * HALF] rotary part of one token's heads in place."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_r = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_r < HALF)
    first = X + offs_h * stride_h + offs_r
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Positions, CosSin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)[None, :]
    row = CosSin + pos * stride_c + offs_r
    cos = tl.load(row, mask=offs_r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=offs_r < HALF, other=0.0).to(tl.float32)
    _rotate_heads(Q + token * stride_qt, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(K + token * stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H,
                  BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """Rotate q and k in place by their tokens' positions (module docstring)."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    assert q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half))


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """The [max_pos, rotary_dim] fp32 cache for `apply_rope` from inv_freq [rotary_dim / 2]
    (the model applies any rope scaling to inv_freq first)."""
    angles = torch.outer(torch.arange(max_pos, device=inv_freq.device).float(), inv_freq.float())
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
