"""Triton building blocks shared by the paged attention kernels (decode and prefill).

Paged layout, per layer and for K and V alike:

    cache [num_blocks, block_size, num_kv_heads, head_dim]
           block b = block_table[seq, pos // block_size], row pos % block_size

A tile of BLOCK_N consecutive positions may span several blocks (BLOCK_N > block_size) or
part of one; every position looks up its own block id, so any pairing of the two works.
Softmax runs in base 2: callers fold log2(e) into `qk_scale`, and log-sum-exps are base 2.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_token_offsets(table_row, offs_n, mask_n, stride_block, stride_slot,
                        PAGE_SIZE: tl.constexpr):
    """Element offsets [BLOCK_N] of positions offs_n of one sequence in a paged cache."""
    blocks = tl.load(table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    return blocks * stride_block + (offs_n % PAGE_SIZE) * stride_slot


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
        k = tl.load(KCache + ptrs, mask=kv_mask, other=0.0)
        v = tl.load(VCache + ptrs, mask=kv_mask, other=0.0)
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
