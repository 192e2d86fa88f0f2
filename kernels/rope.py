"""Rotary position embedding (neox style, HF rotate_half) fused with the KV-cache store.

    q              [T, num_heads, head_dim]       (any strides with unit head_dim stride)
    k, v           [T, num_kv_heads, head_dim]
    positions      [T] int
    cos_sin_cache  [max_pos, rotary_dim]: cos(pos * inv_freq) in the first rotary_dim / 2
                   columns, sin in the rest (fp32 recommended; rope scaling is baked in)
    k/v_cache      [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping   [T] int: token t is stored at block slot // block_size, row
                   slot % block_size; a negative slot (padding) stores nothing
    kv_scale       [2] float32 (K scale, V scale) when the caches are float8_e4m3fn, else None

An fp8 cache stores k / k_scale and v / v_scale, computed in fp32 from the fp32 rotation
(not rounded to the model dtype first) and saturated to +-448 (kernels/reference.py
store_kv_ref is the reference, with rope_ref in front).

The first rotary_dim dims of each head are split in halves x1, x2 and become
(x1 * cos - x2 * sin, x2 * cos + x1 * sin), computed in fp32; dims past rotary_dim are kept.
`rope_store_kv` rotates q in place and writes the rotated k, and v, to their cache slots (k
itself is left as it was). One program per token reads its cos/sin row once and does all of
it: a decode step would otherwise launch a RoPE kernel and a store kernel per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged import FP8_MAX, check_kv_dtype
from kernels.pdl import pdl_args, wait_for_inputs


@triton.jit
def _to_dst(x, Dst, scale, QUANT: tl.constexpr):
    """fp32 x as Dst's elements: with QUANT, x / scale saturated to the fp8 range."""
    if QUANT:
        x = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    return x.to(Dst.dtype.element_ty)


@triton.jit
def _rotate_heads(Src, stride_src, Dst, stride_dst, cos, sin, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  scale=1.0, QUANT: tl.constexpr = False):
    """Rotate the [NUM_HEADS, 2 * HALF] rotary part of one token's heads from Src into Dst
    (which may be Src: each thread stores only the elements it loaded itself); QUANT: Dst
    is an fp8 cache of the values / scale."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_r = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_r < HALF)
    src = Src + offs_h * stride_src + offs_r
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Dst + offs_h * stride_dst + offs_r
    tl.store(dst, _to_dst(x1 * cos - x2 * sin, Dst, scale, QUANT), mask=mask)
    tl.store(dst + HALF, _to_dst(x2 * cos + x1 * sin, Dst, scale, QUANT), mask=mask)


@triton.jit
def _copy_heads(Src, stride_src, Dst, stride_dst, START: tl.constexpr, END: tl.constexpr,
                NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                scale=1.0, QUANT: tl.constexpr = False):
    """Copy dims [START, END) of one token's heads from Src to Dst (QUANT: an fp8 cache of
    the values / scale)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = START + tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < END)
    x = tl.load(Src + offs_h * stride_src + offs_d, mask=mask)
    if QUANT:
        x = _to_dst(x.to(tl.float32), Dst, scale, QUANT)
    tl.store(Dst + offs_h * stride_dst + offs_d, x.to(Dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kv_kernel(
    Q, K, V, KCache, VCache, Positions, SlotMapping, CosSin, KVScale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_c,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_TAIL: tl.constexpr, KV_SCALED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_HALF)[None, :]
    row = CosSin + pos * stride_c + offs_r
    cos = tl.load(row, mask=offs_r < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=offs_r < HALF, other=0.0).to(tl.float32)
    q = Q + token * stride_qt
    _rotate_heads(q, stride_qh, q, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    slot = tl.load(SlotMapping + token).to(tl.int64)
    if slot >= 0:
        at = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
        k_scale = 1.0
        v_scale = 1.0
        if KV_SCALED:
            k_scale = tl.load(KVScale)
            v_scale = tl.load(KVScale + 1)
        k = K + token * stride_kt
        _rotate_heads(k, stride_kh, KCache + at, stride_ch, cos, sin, NUM_KV_HEADS, HALF,
                      BLOCK_KV_H, BLOCK_HALF, k_scale, KV_SCALED)
        if 2 * HALF < HEAD_DIM:   # partial rotary: the rest of k as it is
            _copy_heads(k, stride_kh, KCache + at, stride_ch, 2 * HALF, HEAD_DIM,
                        NUM_KV_HEADS, BLOCK_KV_H, BLOCK_TAIL, k_scale, KV_SCALED)
        _copy_heads(V + token * stride_vt, stride_vh, VCache + at, stride_ch, 0, HEAD_DIM,
                    NUM_KV_HEADS, BLOCK_KV_H, BLOCK_D, v_scale, KV_SCALED)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Rotate q in place; store rotated k and v at their slots (module docstring)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == cos_sin_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if kv_scale is not None or k_cache.dtype == torch.float8_e4m3fn:
        check_kv_dtype(q, k_cache, kv_scale)     # an fp8 cache and its scales, together
    if num_tokens == 0:
        return
    _rope_store_kv_kernel[(num_tokens,)](
        q, k, v, k_cache, v_cache, positions, slot_mapping, cos_sin_cache,
        positions if kv_scale is None else kv_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_TAIL=triton.next_power_of_2(max(1, head_dim - 2 * half)),
        KV_SCALED=kv_scale is not None, **pdl_args(q.device))


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """The [max_pos, rotary_dim] fp32 cache for `rope_store_kv` from inv_freq [rotary_dim / 2]
    (the model applies any rope scaling to inv_freq first)."""
    angles = torch.outer(torch.arange(max_pos, device=inv_freq.device).float(), inv_freq.float())
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
