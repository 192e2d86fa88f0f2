"""DeepSeek MLA's new cache entries: the latent normalised, RoPE on the query's and the key's
rotary parts, and the store, in one kernel (issue 45).

    q             [T, H, N + R]   the query heads (last dim contiguous): the last R values of
                                  each head (q_pe) are rotated in place, q_nope is left alone
    kv            [T, L + R]      kv_a_proj_with_mqa's output: c (L values), then k_pe (R)
    norm_weight   [L]             kv_a_layernorm's weight
    positions     [T] int
    cos, sin      [max_pos, R / 2] fp32 (DeepseekRotary's tables: YaRN's factor baked in)
    cache         [num_blocks, block_size, L + R]  one layer's latent cache (row and block
                                  strides any, last dim contiguous)
    slot_mapping  [T] int: token t's entry goes to block slot // block_size, row slot %
                  block_size; a negative slot (a CUDA graph's padding row) stores nothing

Per token the cache gets [weight * rmsnorm(c), rope(k_pe)], rounded as transformers rounds
them: the norm in fp32, cast to the model dtype, then times the weight; the rotation in fp32
of pairs (x[2i], x[2i+1]) when `interleave` (V2; V3's rope_interleave) or (x[i], x[i + R/2]),
laid out [a cos - b sin | b cos + a sin] either way (pd_cluster/models/deepseek_rope.py).

A decode step would otherwise run, per layer, a copy of c, the norm, two RoPEs of a dozen
elementwise kernels each and the store: at DeepSeek-V2-Lite's batch 64 those small kernels
cost more GPU time than the layer's attention. One program per token does all of it.
Reference: kernels/reference.py `mla_rope_store_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, wait_for_inputs


@triton.jit
def _rotate(src, dst, cos, sin, offs_h, mask_h, stride_h, offs_half,
            HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Rows src + h * stride_h (h in offs_h) of R = 2 * HALF values, rotated into dst."""
    rows = offs_h[:, None] * stride_h
    a_at = offs_half * 2 if INTERLEAVE else offs_half
    b_at = a_at + 1 if INTERLEAVE else offs_half + HALF
    mask = mask_h[:, None]
    a = tl.load(src + rows + a_at[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + rows + b_at[None, :], mask=mask, other=0.0).to(tl.float32)
    out_a = a * cos[None, :] - b * sin[None, :]
    out_b = b * cos[None, :] + a * sin[None, :]
    tl.store(dst + rows + offs_half[None, :], out_a.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + rows + HALF + offs_half[None, :], out_b.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _mla_rope_store_kernel(
    Q, KV, NormWeight, Positions, Cos, Sin, Cache, Slots, eps,
    stride_qt, stride_qh, stride_kvt, stride_cos, stride_cb, stride_cs,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, LATENT: tl.constexpr, HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    INTERLEAVE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_half = tl.arange(0, HALF)
    cos = tl.load(Cos + pos * stride_cos + offs_half)
    sin = tl.load(Sin + pos * stride_cos + offs_half)
    offs_h = tl.arange(0, BLOCK_H)
    # In place: each head's q_pe is read whole before it is written.
    q_pe = Q + t * stride_qt + NOPE
    _rotate(q_pe, q_pe, cos, sin, offs_h, offs_h < NUM_HEADS, stride_qh, offs_half,
            HALF, INTERLEAVE)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    row = Cache + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < LATENT
    c = tl.load(KV + t * stride_kvt + offs_l, mask=mask_l, other=0.0).to(tl.float32)
    normed = c * tl.rsqrt(tl.sum(c * c, 0) / LATENT + eps)
    weight = tl.load(NormWeight + offs_l, mask=mask_l, other=0.0).to(tl.float32)
    normed = normed.to(Cache.dtype.element_ty).to(tl.float32) * weight
    tl.store(row + offs_l, normed.to(Cache.dtype.element_ty), mask=mask_l)
    one = tl.arange(0, 1)
    _rotate(KV + t * stride_kvt + LATENT, row + LATENT, cos, sin, one, one < 1, 0, offs_half,
            HALF, INTERLEAVE)


def mla_rope_store(q: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   interleave: bool, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate q's RoPE parts in place and write each token's cache entry (module docstring)."""
    t, num_heads, head_dim = q.shape
    latent = norm_weight.shape[0]
    half = cos.shape[-1]
    if t == 0:
        return
    assert kv.shape == (t, latent + 2 * half) and cache.shape[-1] == latent + 2 * half
    assert q.stride(-1) == 1 and kv.stride(-1) == 1 and cache.stride(-1) == 1
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    assert half == triton.next_power_of_2(half), f"RoPE dim {2 * half}: a power of two"
    _mla_rope_store_kernel[(t,)](
        q, kv, norm_weight, positions, cos, sin, cache, slot_mapping, eps,
        q.stride(0), q.stride(1), kv.stride(0), cos.stride(0), cache.stride(0),
        cache.stride(1), NUM_HEADS=num_heads, NOPE=head_dim - 2 * half, LATENT=latent,
        HALF=half, PAGE_SIZE=cache.shape[1], BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_L=triton.next_power_of_2(latent), INTERLEAVE=interleave, num_warps=4,
        **pdl_args(q.device))
