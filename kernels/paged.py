"""Triton building blocks shared by the paged attention kernels (decode and prefill).

Paged layout, per layer and for K and V alike:

    cache [num_blocks, block_size, num_kv_heads, head_dim]
           block b = block_table[seq, pos // block_size], row pos % block_size

A tile of BLOCK_N consecutive positions may span several blocks (BLOCK_N > block_size) or
part of one; every position looks up its own block id, so any pairing of the two works.
Softmax runs in base 2: callers fold log2(e) into `qk_scale`, and log-sum-exps are base 2.

An fp8 (e4m3) cache holds value / scale, one K and one V scale per layer. Tiles are read as
fp8 and widened to q's dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value), and
the scales are applied once per program by the callers: K's folded into `qk_scale` (scores
and softmax stay fp32), V's multiplied into the finished output (`load_kv_scales`).
Measured on an H100 (bf16 q, 32 heads, 8 KV heads, head_dim 128, block 16): decode over fp8
KV took 339 / 293 / 184 us against bf16's 364 / 372 / 190 us at 64 x 4096, 256 x 1024 and
8 x 16384 tokens of context: half the bytes, but not half the time (bf16 already ran at
~2.9 TB/s; widening the tiles costs). Tried and slower on an H100 (64 x 1024 and 256 x 1024,
2026-11-25): the scores as (k @ q.T).T, so the widened K tile is wgmma's register operand
(1.84 against 1.92 TB/s, 2.19 against 2.34). An fp8 tensor-core dot (q quantized) is left to
try.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)   # the largest finite float8_e4m3fn: stores saturate to it


def check_kv_dtype(q: torch.Tensor, k_cache: torch.Tensor, kv_scale: torch.Tensor | None):
    """A launcher's check: the cache is in q's dtype (kv_scale None), or float8_e4m3fn with
    its [K scale, V scale] float32 tensor on the cache's device."""
    if kv_scale is None:
        assert q.dtype == k_cache.dtype, f"KV cache {k_cache.dtype} for q {q.dtype}"
        return
    assert k_cache.dtype == torch.float8_e4m3fn, f"kv_scale given for a {k_cache.dtype} cache"
    assert kv_scale.dtype == torch.float32 and kv_scale.numel() >= 2 \
        and kv_scale.device == k_cache.device and kv_scale.stride(-1) == 1


@triton.jit
def paged_token_offsets(table_row, offs_n, mask_n, stride_block, stride_slot,
                        PAGE_SIZE: tl.constexpr):
    """Element offsets [BLOCK_N] of positions offs_n of one sequence in a paged cache."""
    blocks = tl.load(table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    return blocks * stride_block + (offs_n % PAGE_SIZE) * stride_slot


@triton.jit
def load_kv_scales(KVScale, qk_scale, KV_SCALED: tl.constexpr):
    """(qk_scale with K's scale folded in, V's scale) of an fp8 cache: KVScale points at
    [K scale, V scale] fp32 (a tensor, so a CUDA graph reads the values at replay); without
    KV_SCALED, (qk_scale, 1.0) and nothing is read."""
    v_scale = 1.0
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(KVScale)
        v_scale = tl.load(KVScale + 1)
    return qk_scale, v_scale


@triton.jit
def dot_dtype(q, KV_SCALED: tl.constexpr):
    """q in the dtype the tiles are widened to: float16 for an fp8 cache (e4m3 → f16 is one
    conversion instruction per pair of values on sm89+; e4m3 → bf16 goes through f32, which
    made an fp8 decode as slow as a bf16 one on an H100), else q's own dtype."""
    if KV_SCALED:       # a constexpr branch: one return (Triton types both returns alike)
        q = q.to(tl.float16)
    return q


@triton.jit
def attend_paged_range(acc, m_i, l_i, q, q_pos, KCache, VCache, table_row, head_offset,
                       start, end, qk_scale, stride_block, stride_slot, offs_d, mask_d,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr,
                       CAUSAL: tl.constexpr):
    """Online-softmax attention of q [M, BLOCK_D] to positions [start, end) of one sequence.

    acc [M, BLOCK_D] (unnormalised output), m_i [M] (running max), l_i [M] (running sum)
    are carried in and returned. BOUNDS masks scores past `end` (a ragged last tile); CAUSAL
    lets row r see only positions <= q_pos[r]; with neither, every tile must be full.
    Each K/V tile is loaded once for all M rows: for decode the rows are the query heads of
    one KV head's group, which is how GQA reads the cache once per group.
    """
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = head_offset + paged_token_offsets(table_row, offs_n, mask_n, stride_block,
                                                 stride_slot, PAGE_SIZE)
        ptrs = rows[:, None] + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # .to(q.dtype): fp8 tiles widened for tl.dot (callers pass q as float16 then, see
        # dot_dtype); a no-op for a cache in q's dtype.
        k = tl.load(KCache + ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(VCache + ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if BOUNDS:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        if CAUSAL:
            qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
        # Callers ensure each row has seen a position by the end of its first tile, so
        # m_new stays finite (no -inf - -inf = NaN).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i
