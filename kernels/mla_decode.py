"""DeepSeek multi-head latent attention (MLA), decode: one query token per sequence over a paged
LATENT KV cache, with the projections absorbed by the caller (issue 45).

    q_latent      [B, H, L]   q_nope[h] @ W_UK[h]: each head's query in the latent space
    q_pe          [B, H, R]   each head's rotated RoPE query
                  (bf16 / fp16, or fp32 on CPU; last dims contiguous)
    kv_cache      [num_blocks, block_size, L + R]   one layer: per token the normalised latent
                  c (first L values) then the rotated RoPE key k_pe (R values); block and row
                  strides are any, the last dim contiguous
    block_tables  [B, max_blocks_per_seq] int32
    seq_lens      [B] int32: context length including the new token (>= 1)
    scale         float: softmax scale
    out           [B, H, L], q's dtype: out[h] = sum_t softmax_t(scale * (q_latent[h] . c[t] +
                  q_pe[h] . k_pe[t])) * c[t], which the caller maps back with W_UV

DeepSeek-V2/V3: L (kv_lora_rank) 512, R (qk_rope_head_dim) 64, H 16 (V2-Lite) or 128 (V3: 16
a rank at TP 8). All H heads share the one cached row per token, so MLA is GQA with a single
KV head and a group of H: every program takes BLOCK_H heads of one sequence as the rows of
its dots, so each cache tile it reads serves BLOCK_H heads. K is the whole row (L + R = 576
values) and V its first L: one tile load gives both, and the score is two dots (latent and
RoPE parts, padded apart to powers of two) summed.

Split-KV ("flash decoding") as kernels/decode_attention.py, whose split rule, chunking and
stage 2 this reuses. Stage 1, grid (ceil(H / BLOCK_H), B, num_splits): a program attends
BLOCK_H heads to one contiguous chunk of a sequence with an online softmax and writes the
chunk's normalised output and base-2 log-sum-exp to fp32 scratch:

    partial_out [B, H, num_splits, L]    partial_lse [B, H, num_splits]

Stage 2 (kernels/decode_attention.py _decode_stage2_kernel), grid (B, H), merges a
sequence's non-empty chunks by their log-sum-exp. With one split stage 1 writes `out`
directly and stage 2 is not launched. Reference: `mla_decode_ref`.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.decode_attention import (PROGRAMS_PER_SM, _decode_stage2_kernel, _num_sms,
                                      _split_len, choose_num_splits)
from kernels.paged import lazy_softmax_tile, paged_token_offsets
from kernels.pdl import pdl_args, wait_for_inputs

# Launch defaults, chosen from the sm90 compile (registers by cuobjdump), not yet by timing on
# a GPU. BLOCK_H: heads per program, the least M that tl.dot takes. A program keeps q for
# the whole loop in registers, and its 4 warps' mma.sync each hold all of it as an operand
# ([16, 576] bf16: ~144 registers a thread), beside the fp32 accumulator [16, 512] (64). With
# 16-token tiles (18 KiB of cache) and two stages that is 196 registers a thread, no spills,
# 38 KiB of shared memory; 32-token tiles reach 255 registers and spill, as do 32 or 64
# heads a program (wgmma at 64) with 4 or 8 warps.
BLOCK_H = 16
BLOCK_N = 16
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _attend_latent_range(acc, m_i, l_i, q_lat, q_pe, KVCache, table_row, start, end, qk_scale,
                         stride_block, stride_slot, offs_l, mask_l, offs_r, mask_r,
                         LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BOUNDS: tl.constexpr):
    """Online softmax of q (q_lat [BLOCK_H, BLOCK_L], q_pe [BLOCK_H, BLOCK_R]) over positions
    [start, end) of one sequence; acc [BLOCK_H, BLOCK_L] (unnormalised), m_i, l_i [BLOCK_H]
    (running base-2 max and sum) are carried in and returned. BOUNDS masks the positions past
    `end` (the ragged last tile); without it every tile must be full.

    The rescale is lazy, as kernels/paged.py attend_paged_range LAZY: acc is L wide (512),
    so multiplying it by alpha every tile costs as much float work as the scores."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = paged_token_offsets(table_row, offs_n, mask_n, stride_block, stride_slot,
                                   PAGE_SIZE)
        c = tl.load(KVCache + rows[:, None] + offs_l[None, :],
                    mask=mask_n[:, None] & mask_l[None, :], other=0.0)
        k_pe = tl.load(KVCache + rows[:, None] + LATENT + offs_r[None, :],
                       mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        qk = tl.dot(q_lat, tl.trans(c))
        qk = tl.dot(q_pe, tl.trans(k_pe), qk) * qk_scale
        if BOUNDS:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        # Every chunk's first tile holds a position, so the running max is finite from the
        # first tile; V is the latent itself.
        acc, m_i, l_i = lazy_softmax_tile(acc, m_i, l_i, qk, c)
    return acc, m_i, l_i


@triton.jit
def _chunk(SeqLens, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """Positions [start, end) of sequence `seq` that split `split` attends to (empty past the
    sequence's last chunk), as kernels/decode_attention.py stage 1 and 2 cut them."""
    seq_len = tl.load(SeqLens + seq)
    chunk = _split_len(seq_len, num_splits, BLOCK_N)
    return split * chunk, tl.minimum(split * chunk + chunk, seq_len)


# As kernels/decode_attention.py: the step-varying integers (split count, table width, scratch
# strides) are not specialized on, nor is the alignment of the step's uploaded inputs, so a
# new batch or context does not compile a variant in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_pb", "stride_ph", "stride_ps",
                               "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["BlockTables", "SeqLens"])
def _mla_stage1_kernel(
    QLatent, QPe, KVCache, BlockTables, SeqLens, PartialOut, PartialLse, qk_scale, num_splits,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cb, stride_cs, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
):
    """DIRECT (one split): PartialOut is the output [B, H, L] itself, PartialLse is unused and
    stride_ps is 0."""
    # Head blocks vary fastest across programs: the programs that run together read the same
    # cache rows, so all but the first find them in L2.
    wait_for_inputs(PDL)
    head_block, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _chunk(SeqLens, seq, split, num_splits, BLOCK_N)
    if start >= end:
        return
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < LATENT
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROPE
    q_lat = tl.load(QLatent + seq * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :],
                    mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(QPe + seq * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :],
                   mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    # Whole tiles first, their scores unmasked; then the ragged last one, if any, masked.
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    table_row = BlockTables + seq * stride_bt
    acc, m_i, l_i = _attend_latent_range(
        acc, m_i, l_i, q_lat, q_pe, KVCache, table_row, start, full_end, qk_scale, stride_cb,
        stride_cs, offs_l, mask_l, offs_r, mask_r, LATENT=LATENT, PAGE_SIZE=PAGE_SIZE,
        BLOCK_N=BLOCK_N, BOUNDS=False)
    acc, m_i, l_i = _attend_latent_range(
        acc, m_i, l_i, q_lat, q_pe, KVCache, table_row, full_end, end, qk_scale, stride_cb,
        stride_cs, offs_l, mask_l, offs_r, mask_r, LATENT=LATENT, PAGE_SIZE=PAGE_SIZE,
        BLOCK_N=BLOCK_N, BOUNDS=True)
    out = acc / l_i[:, None]
    part = PartialOut + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    tl.store(part + offs_l[None, :], out.to(PartialOut.dtype.element_ty),
             mask=mask_h[:, None] & mask_l[None, :])
    if not DIRECT:
        tl.store(PartialLse + seq * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                 mask=mask_h)


def stage1_meta(num_heads: int, latent: int, rope: int, page_size: int, device: torch.device,
                block_h: int = BLOCK_H, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                num_stages: int = NUM_STAGES) -> dict:
    """The stage-1 kernel's constexprs and launch options for these shapes (also what the
    sm90 compile check in tests/kernels/test_mla.py builds)."""
    return dict(NUM_HEADS=num_heads, LATENT=latent, ROPE=rope, PAGE_SIZE=page_size,
                BLOCK_H=block_h, BLOCK_L=max(16, triton.next_power_of_2(latent)),
                BLOCK_R=max(16, triton.next_power_of_2(rope)), BLOCK_N=block_n,
                num_warps=num_warps, num_stages=num_stages, **pdl_args(device))


def mla_decode(
    q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    max_seq_len: int | None = None, out: torch.Tensor | None = None,
    num_splits: int | None = None, block_h: int = BLOCK_H, block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """Attend each sequence's query heads to its paged latent context (module docstring).

    max_seq_len (a host int) sizes the split count without a device sync. num_splits
    defaults to kernels/decode_attention.py choose_num_splits over the B x ceil(H / block_h)
    programs of one split; block_h / block_n / num_warps / num_stages are tuning knobs.
    """
    batch, num_heads, latent = q_latent.shape
    rope = q_pe.shape[-1]
    out = torch.empty_like(q_latent) if out is None else out
    if batch == 0:
        return out
    assert kv_cache.shape[-1] == latent + rope and kv_cache.stride(-1) == 1
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1 and out.stride(-1) == 1
    assert q_latent.dtype == q_pe.dtype == kv_cache.dtype == out.dtype, \
        (q_latent.dtype, q_pe.dtype, kv_cache.dtype, out.dtype)
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = choose_num_splits(batch * head_blocks, max_seq_len,
                                       _num_sms(q_latent.device), PROGRAMS_PER_SM)
    meta = stage1_meta(num_heads, latent, rope, kv_cache.shape[1], q_latent.device, block_h,
                       block_n, num_warps, num_stages)
    stage1 = functools.partial(
        _mla_stage1_kernel[(head_blocks, batch, num_splits)], q_latent, q_pe, kv_cache,
        block_tables, seq_lens)
    strides = (*q_latent.stride()[:2], *q_pe.stride()[:2], *kv_cache.stride()[:2],
               block_tables.stride(0))
    qk_scale = scale * math.log2(math.e)    # the softmax runs in base 2
    if num_splits == 1:
        stage1(out, out, qk_scale, 1, *strides, out.stride(0), out.stride(1), 0, 0, 0,
               DIRECT=True, **meta)
        return out
    partial_out = torch.empty(batch, num_heads, num_splits, latent, dtype=torch.float32,
                              device=q_latent.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32,
                              device=q_latent.device)
    stage1(partial_out, partial_lse, qk_scale, num_splits, *strides,
           *partial_out.stride()[:3], *partial_lse.stride()[:2], DIRECT=False, **meta)
    _decode_stage2_kernel[(batch, num_heads)](
        partial_out, partial_lse, seq_lens, out, num_splits,
        *partial_out.stride()[:3], *partial_lse.stride()[:2], out.stride(0), out.stride(1),
        HEAD_DIM=latent, BLOCK_D=meta["BLOCK_L"], BLOCK_N=block_n, OUT_FP8=False, num_warps=4,
        **pdl_args(q_latent.device))
    return out


def mla_decode_ref(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """`mla_decode` in fp32 torch: each sequence's rows gathered through its block table,
    the output cast to q's dtype at the end."""
    latent, block_size = q_latent.shape[-1], kv_cache.shape[1]
    out = torch.empty_like(q_latent)
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        rows = kv_cache[blocks].flatten(0, 1)[:seq_len].float()        # [seq_len, L + R]
        q = torch.cat([q_latent[i], q_pe[i]], -1).float()             # [H, L + R]
        probs = (q @ rows.T * scale).softmax(-1)
        out[i] = (probs @ rows[:, :latent]).to(out.dtype)
    return out
