"""Paged decode attention, split-KV ("flash decoding"): one query token per sequence.

    q             [B, num_heads, head_dim]
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]   (same strides)
    block_tables  [B, max_blocks_per_seq] int32
    seq_lens      [B] int32: context length including the new token (>= 1)
    out           [B, num_heads, head_dim], q's dtype; or float8_e4m3fn with an fp8 cache: the
                  values / V's scale, the FP8 o projection's input (kernels/paged.py)
    kv_scale      [2] float32 (K scale, V scale) when the caches are float8_e4m3fn (values =
                  fp8 * scale), else None (caches in q's dtype)

Stage 1, grid (num_kv_heads, B, num_splits): a program takes one contiguous chunk of a
sequence's context and all query heads of one KV head as a [BLOCK_H, head_dim] tile (group
padded to >= 16 rows for tl.dot), so each K/V tile is read from memory once per group.
One-warp programs (`one_warp`) take the group transposed, as the dots' N dimension (padded
to 8 columns; kernels/paged.py attend_paged_range_t). It writes the chunk's normalised
output and log-sum-exp (base 2) to fp32 scratch:

    partial_out [B, num_heads, num_splits, head_dim]    partial_lse [B, num_heads, num_splits]

Stage 2, grid (B, num_heads): merges a sequence's non-empty chunks by their log-sum-exp.
Chunks are multiples of BLOCK_N long, so short sequences simply use fewer of them. With one
chunk per sequence (large batches fill the GPU without splitting) stage 1 writes `out`
directly and stage 2 is not launched: one kernel less per layer, no fp32 scratch.

An fp8 cache's tiles are widened to float16 in stage 1 (V by PTX on GPUs, kernels/paged.py);
K's scale joins qk_scale and V's scales each chunk's output (kernels/paged.py), so stage 2
merges outputs already in value units. Reference: kernels/reference.py decode_attention_ref.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.paged import (FP8_MAX, attend_paged_range, attend_paged_range_t, check_kv_dtype,
                           check_out_dtype, dot_dtype, finish_output, load_kv_scales,
                           widen_by_ptx)
from kernels.pdl import pdl_args, wait_for_inputs

# Splitting fills the GPU when batch x kv_heads is small. KV bandwidth saturates once about 3.5
# stage-1 programs per SM are in flight, whatever the occupancy allows; more splits only add
# merge work (docs/performance.md, "Decode attention").
PROGRAMS_PER_SM = 3.5
MIN_SPLIT_TOKENS = 256    # shorter chunks cost more in stage 2 than they win in stage 1
MAX_SPLITS = 64
DEFAULT_SMS = 132         # H100/H200, used off-GPU (the interpreter) to keep choices stable


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per chunk: an even share of seq_len rounded up to whole tiles."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


# Integer arguments that change from step to step are not specialized on (Triton would
# otherwise compile a variant, ~1 s, each time one is first 1 or first a multiple of 16:
# stalls in the middle of serving), nor is the alignment of pointers that changes with the
# step: its inputs are 8-byte aligned views of one packed upload (pd_cluster/upload.py), and
# an unscaled (16-bit) cache passes the sequence lengths as KVScale.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_pb", "stride_ph", "stride_ps",
                               "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["BlockTables", "SeqLens", "KVScale"])
def _decode_stage1_kernel(
    Q, KCache, VCache, BlockTables, SeqLens, PartialOut, PartialLse, KVScale, qk_scale,
    num_splits,
    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    KV_SCALED: tl.constexpr, V_PTX: tl.constexpr, OUT_FP8: tl.constexpr, PDL: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """DIRECT (one split): PartialOut is the output [B, num_heads, head_dim] itself and
    PartialLse is unused; stride_ps is 0. OUT_FP8: the output is fp8 in V's units
    (kernels/paged.py finish_output); split partials are then in V's units too.
    TRANSPOSED: the query heads are the dots' N dimension (kernels/paged.py
    attend_paged_range_t), for one-warp programs."""
    # KV heads vary fastest across programs: the group of programs that runs together reads
    # all heads of the same blocks, whose rows lie side by side in memory.
    wait_for_inputs(PDL)
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    chunk = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start >= end:
        return
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    qk_scale, v_scale = load_kv_scales(KVScale, qk_scale, KV_SCALED)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Whole tiles first, their scores unmasked; then the ragged last one, if any, masked.
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    table_row = BlockTables + seq * stride_bt
    if TRANSPOSED:
        q_t = tl.load(Q + seq * stride_qb + heads[None, :] * stride_qh + offs_d[:, None],
                      mask=mask_d[:, None] & mask_h[None, :], other=0.0)
        q_t = dot_dtype(q_t, KV_SCALED)
        acc_t = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
        acc_t, m_i, l_i = attend_paged_range_t(
            acc_t, m_i, l_i, q_t, KCache, VCache, table_row, kv_head * stride_ch, start,
            full_end, qk_scale, stride_cb, stride_cs, offs_d, mask_d, PAGE_SIZE=PAGE_SIZE,
            BLOCK_N=BLOCK_N, BOUNDS=False, V_PTX=V_PTX)
        acc_t, m_i, l_i = attend_paged_range_t(
            acc_t, m_i, l_i, q_t, KCache, VCache, table_row, kv_head * stride_ch, full_end,
            end, qk_scale, stride_cb, stride_cs, offs_d, mask_d, PAGE_SIZE=PAGE_SIZE,
            BLOCK_N=BLOCK_N, BOUNDS=True, V_PTX=V_PTX)
        out = tl.trans(acc_t / l_i[None, :])
    else:
        q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        q = dot_dtype(q, KV_SCALED)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        acc, m_i, l_i = attend_paged_range(
            acc, m_i, l_i, q, offs_h, KCache, VCache, table_row, kv_head * stride_ch, start,
            full_end, qk_scale, stride_cb, stride_cs, offs_d, mask_d, PAGE_SIZE=PAGE_SIZE,
            BLOCK_N=BLOCK_N, BOUNDS=False, CAUSAL=False, V_PTX=V_PTX, LAZY=True)
        acc, m_i, l_i = attend_paged_range(
            acc, m_i, l_i, q, offs_h, KCache, VCache, table_row, kv_head * stride_ch,
            full_end, end, qk_scale, stride_cb, stride_cs, offs_d, mask_d,
            PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, BOUNDS=True, CAUSAL=False, V_PTX=V_PTX,
            LAZY=True)
        out = acc / l_i[:, None]
    part = PartialOut + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    if DIRECT or not OUT_FP8:       # split fp8 partials are clamped once merged (stage 2)
        out = finish_output(out, v_scale, OUT_FP8)
    tl.store(part + offs_d[None, :], out.to(PartialOut.dtype.element_ty),
             mask=mask_h[:, None] & mask_d[None, :])
    if not DIRECT:
        tl.store(PartialLse + seq * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                 mask=mask_h)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_ps",
                               "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["SeqLens"])
def _decode_stage2_kernel(
    PartialOut, PartialLse, SeqLens, Out, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    OUT_FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(SeqLens + seq)
    used_splits = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    part = PartialOut + seq * stride_pb + head * stride_ph + offs_d
    lse_row = PartialLse + seq * stride_lb + head * stride_lh
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = float("-inf")
    total = 0.0
    for split in range(0, used_splits):
        lse = tl.load(lse_row + split)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha + weight * tl.load(part + split * stride_ps, mask=mask_d, other=0.0)
        total = total * alpha + weight
        m = m_new
    out = acc / total
    if OUT_FP8:     # the partials are in V's units (stage 1); see finish_output
        out = tl.minimum(tl.maximum(out, -FP8_MAX), FP8_MAX)
    tl.store(Out + seq * stride_ob + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(seq_heads: int, max_seq_len: int, num_sms: int,
                      programs_per_sm: float = PROGRAMS_PER_SM) -> int:
    """Chunks per sequence for seq_heads = batch x kv_heads stage-1 programs per chunk: the
    fewest that put `programs_per_sm` programs on every SM, if the context is long enough."""
    wanted = math.ceil(programs_per_sm * num_sms / seq_heads)
    worthwhile = triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)
    return max(1, min(wanted, worthwhile, MAX_SPLITS))


# One-warp fp8 programs (`one_warp`): from this many sequence-heads (batch x KV heads) at
# any context, or from ONE_WARP_MIN_SPLIT_HEADS over contexts longer than ONE_WARP_CONTEXT,
# split so that about FP8_PROGRAMS_PER_SM of them run per SM.
ONE_WARP_MIN_SEQ_HEADS = 1024
ONE_WARP_MIN_SPLIT_HEADS = 128
ONE_WARP_CONTEXT = 1024
FP8_PROGRAMS_PER_SM = 7.0
# One-warp programs prefetch two K/V tiles ahead: Triton gives a load whose address comes from
# another load (the page table) one shared-memory buffer at num_stages 2-4, two at 5-6.
ONE_WARP_STAGES = 5


def one_warp(head_dim: int, fp8: bool, seq_heads: int, max_seq_len: int) -> bool:
    """Whether an fp8 decode runs one-warp programs over 32-token tiles instead of 4-warp
    programs over 64/128 tokens.

    The fp8 kernel is latency-bound, not bandwidth-bound: with 4-warp programs and one tile in
    flight it read its KV well below the rate at which the same kernel reads a bf16 cache.
    More, smaller programs hide more of each one's latency. From ONE_WARP_MIN_SEQ_HEADS
    sequence-heads (batch 128 at 8 KV heads, one split) there are enough of them at any
    context. With fewer, one-warp programs need splits to fill the GPU, and the splits pay off
    only over long contexts: over short ones they are slower, which is why
    pd_cluster/cuda_graphs.py captures short-context graphs apart. Below
    ONE_WARP_MIN_SPLIT_HEADS they are level or slower. The measurements, on H200 and H100:
    docs/performance.md, "Decode attention"."""
    if not fp8 or head_dim > 128:
        return False
    return seq_heads >= ONE_WARP_MIN_SEQ_HEADS or (
        seq_heads >= ONE_WARP_MIN_SPLIT_HEADS and max_seq_len > ONE_WARP_CONTEXT)


def _block_n(head_dim: int, fp8: bool, single_warp: bool, programs: int, num_sms: int) -> int:
    """Tokens per K/V tile. 16-bit: 64 (32 past head_dim 128, for registers). One-warp fp8
    programs (transposed): 32, with two tiles in flight (ONE_WARP_STAGES); 16-token tiles, the
    faster with one buffer (fewer registers, more programs per SM), are the slower with two.
    Otherwise an fp8 tile of 128 tokens holds the bytes of a 16-bit tile of 64, and once V is
    widened in registers (kernels/paged.py) 128 is the faster while more than ~4 programs per
    SM queue up, 64 below that, where each program's chain of tiles is the critical path.
    Where an H100 and an H200 disagree, the rule follows the H200 (docs/performance.md,
    "Decode attention")."""
    if head_dim > 128 or single_warp:
        return 32
    if not fp8:
        return 64
    return 128 if programs > 4 * num_sms else 64


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, max_seq_len: int | None = None,
    out: torch.Tensor | None = None, num_splits: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None,
    maxnreg: int | None = None, transposed: bool | None = None,
) -> torch.Tensor:
    """Attend each sequence's single query token to its paged context (module docstring).

    max_seq_len (a host int) sizes the split count and programs without a device sync; the
    tuning knobs num_splits / block_n / num_warps / num_stages / maxnreg (a cap on registers
    per thread, so more programs fit an SM) / transposed (the heads as the dots' N
    dimension) default to the launcher's own choice: num_stages 3 (one K/V tile in flight),
    ONE_WARP_STAGES for one-warp programs.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    check_kv_dtype(q, k_cache, kv_scale)
    out_fp8 = check_out_dtype(out, kv_scale)
    fp8, sms = kv_scale is not None, _num_sms(q.device)
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    single = one_warp(head_dim, fp8, batch * num_kv_heads, max_seq_len)
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_seq_len, sms,
                                       FP8_PROGRAMS_PER_SM if single else PROGRAMS_PER_SM)
    block_n = block_n or _block_n(head_dim, fp8, single, batch * num_kv_heads * num_splits, sms)
    num_warps = num_warps or (1 if single else 4)
    num_stages = num_stages or (ONE_WARP_STAGES if single else 3)
    transposed = single if transposed is None else transposed
    block_d = triton.next_power_of_2(head_dim)
    group = num_heads // num_kv_heads
    meta = dict(GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
                BLOCK_H=max(8 if transposed else 16, triton.next_power_of_2(group)),
                BLOCK_D=block_d, TRANSPOSED=transposed,
                BLOCK_N=block_n, KV_SCALED=kv_scale is not None,
                V_PTX=kv_scale is not None and widen_by_ptx(q.device), OUT_FP8=out_fp8,
                num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device),
                **({} if maxnreg is None else {"maxnreg": maxnreg}))
    stage1 = functools.partial(
        _decode_stage1_kernel[(num_kv_heads, batch, num_splits)], q, k_cache, v_cache,
        block_tables, seq_lens)
    scales = seq_lens if kv_scale is None else kv_scale   # any pointer when unscaled
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0))
    qk_scale = scale * math.log2(math.e)
    if num_splits == 1:
        stage1(out, out, scales, qk_scale, 1, *strides, out.stride(0), out.stride(1), 0, 0, 0,
               DIRECT=True, **meta)
        return out
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                              device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    stage1(partial_out, partial_lse, scales, qk_scale, num_splits, *strides,
           *partial_out.stride()[:3], *partial_lse.stride()[:2], DIRECT=False, **meta)
    _decode_stage2_kernel[(batch, num_heads)](
        partial_out, partial_lse, seq_lens, out, num_splits,
        *partial_out.stride()[:3], *partial_lse.stride()[:2], out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, OUT_FP8=out_fp8, num_warps=4,
        **pdl_args(q.device))
    return out
