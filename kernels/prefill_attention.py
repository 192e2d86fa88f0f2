"""Varlen causal prefill attention over the paged KV cache (chunked prefill, prefix hits).

    q                [T, num_heads, head_dim], sequences flattened by query_start_loc
    k/v_cache        [num_blocks, block_size, num_kv_heads, head_dim]   (same strides)
    block_tables     [B, max_blocks_per_seq] int32
    seq_lens         [B] int32: context length after this step (cached + new tokens)
    query_start_loc  [B + 1] int32: cumulative query lengths
    out              [T, num_heads, head_dim], q's dtype; or float8_e4m3fn with an fp8 cache
                     (values / V's scale: kernels/paged.py finish_output)
    kv_scale         [2] float32 (K scale, V scale) when the caches are float8_e4m3fn (values
                     = fp8 * scale), else None (caches in q's dtype)

Query j of a sequence with q_len new tokens sits at position seq_len - q_len + j and sees
positions 0..its own. K/V are read from the cache only, so the new tokens must be stored
first (rope_store_kv); a cached prefix then needs nothing special.

Grid (cdiv(max_query_len, BLOCK_M), num_heads, B): a program owns BLOCK_M queries of one head.
Keys up to its first query's position are visible to all its rows and run without any mask;
only the tiles on the diagonal pay for the causal one. That mask also hides positions past
the sequence in the last tile from every row that is stored (row j sees <= its own position).
An fp8 cache's tiles are widened to q's dtype; K's scale joins qk_scale, V's scales the
output (kernels/paged.py). Reference: kernels/reference.py paged_attention_ref.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.paged import (attend_paged_range, check_kv_dtype, check_out_dtype, dot_dtype,
                           finish_output, load_kv_scales)


# stride_bt (the block table's width: the batch's longest context) changes from step to
# step: not specialized on, so it never triggers a new compile mid-serving. Nor is the
# alignment of the metadata pointers: the backend passes them sliced past the step's decode
# rows, so whether they are 16-byte aligned changes with the batch (a ~1 s compile on the
# first unaligned step); they are read a scalar at a time, so alignment buys nothing. The
# same holds for KVScale, which an unscaled (16-bit) cache fills with the sequence lengths.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["BlockTables", "SeqLens", "QueryStartLoc", "KVScale"])
def _prefill_kernel(
    Q, KCache, VCache, BlockTables, SeqLens, QueryStartLoc, Out, KVScale, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_SCALED: tl.constexpr, OUT_FP8: tl.constexpr,
):
    m_block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    context = tl.load(SeqLens + seq) - q_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    qk_scale, v_scale = load_kv_scales(KVScale, qk_scale, KV_SCALED)
    q = dot_dtype(q, KV_SCALED)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = BlockTables + seq * stride_bt
    head_offset = (head // GROUP) * stride_ch
    q_pos = context + offs_m
    unmasked_end = (context + m0 + 1) // BLOCK_N * BLOCK_N
    kv_end = context + tl.minimum(m0 + BLOCK_M, q_len)
    acc, m_i, l_i = attend_paged_range(
        acc, m_i, l_i, q, q_pos, KCache, VCache, table_row, head_offset, 0, unmasked_end,
        qk_scale, stride_cb, stride_cs, offs_d, mask_d,
        PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BOUNDS=False, CAUSAL=False)
    acc, m_i, l_i = attend_paged_range(
        acc, m_i, l_i, q, q_pos, KCache, VCache, table_row, head_offset, unmasked_end, kv_end,
        qk_scale, stride_cb, stride_cs, offs_d, mask_d,
        PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BOUNDS=False, CAUSAL=True)
    tl.store(Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             finish_output(acc / l_i[:, None], v_scale, OUT_FP8).to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int = 2, kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query token to its paged context (module docstring).

    max_query_len (a host int) sizes the grid; the tuning knobs default to the launcher's
    own choice.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    check_kv_dtype(q, k_cache, kv_scale)
    out_fp8 = check_out_dtype(out, kv_scale)
    # Large tiles amortise the K/V loads; head_dim 256 halves them to fit shared memory.
    block_m = block_m or (64 if head_dim <= 128 else 32)
    block_n = block_n or (64 if head_dim <= 128 else 32)
    num_warps = num_warps or (4 if block_m <= 64 else 8)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        seq_lens if kv_scale is None else kv_scale, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        KV_SCALED=kv_scale is not None, OUT_FP8=out_fp8, num_warps=num_warps,
        num_stages=num_stages)
    return out
