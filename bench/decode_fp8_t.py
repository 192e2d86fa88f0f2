"""Experiment: fp8 decode attention computed transposed, against the shipped kernel
(Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, block 16).

    PYTHONPATH=. python bench/decode_fp8_t.py [--cases 64x1024,256x1024] [--vt]

The shipped kernel computes S = q K^T [BLOCK_H, BLOCK_N] and O = P V [BLOCK_H, head_dim] with
the group's query heads as the dots' M dimension, padded to 16 rows for 4 real ones: the
accumulator, the scores and the softmax work are 4x what the group needs, and a one-warp
program needs 220 registers a thread (8 programs per SM). Here the heads are the N
dimension, which an mma.sync tile makes 8 wide: S^T = K q^T [BLOCK_N, BLOCK_H] and
O^T = V^T P^T [head_dim, BLOCK_H], half the accumulator and half the MMAs (shipped since in
kernels/paged.py attend_paged_range_t). --vt: the same over V pages stored transposed,
[num_blocks, num_kv_heads, head_dim, block_size], so V^T reaches its dot as K does (ldmatrix
of e4m3 pairs), not through a float16 copy in shared memory. Prints one JSON
object; times are medians of triton.testing.do_bench, GB/s counts the K and V bytes read,
and each row gives the max abs error against the fp32 reference.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.paged import LAZY_LOG2, widen_e4m3  # noqa: E402
from kernels.reference import decode_attention_ref  # noqa: E402


@triton.jit
def _t_loop(acc_t, m_i, l_i, q_t, KCache, VCache, table_row, head_offset, start, end,
            qk_scale, stride_cb, stride_cs, offs_d, PAGE_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr, V_PTX: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if BOUNDS:
            blocks = tl.load(table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        else:
            blocks = tl.load(table_row + offs_n // PAGE_SIZE)
        rows = head_offset + blocks.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs
        ptrs = rows[:, None] + offs_d[None, :]
        if BOUNDS:
            k = tl.load(KCache + ptrs, mask=mask_n[:, None], other=0.0)
            v = tl.load(VCache + ptrs, mask=mask_n[:, None], other=0.0)
        else:
            k = tl.load(KCache + ptrs)
            v = tl.load(VCache + ptrs)
        s_t = tl.dot(k.to(tl.float16), q_t) * qk_scale          # [BLOCK_N, BLOCK_H]
        if BOUNDS:
            s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        if tl.max(m_new - m_i, 0) > LAZY_LOG2:
            alpha = tl.exp2(m_i - m_new)
            acc_t = acc_t * alpha[None, :]
            l_i = l_i * alpha
            m_i = m_new
        p_t = tl.exp2(s_t - m_i[None, :])
        acc_t = tl.dot(tl.trans(widen_e4m3(v, V_PTX)), p_t.to(tl.float16), acc_t)
        l_i = l_i + tl.sum(p_t, 0)
    return acc_t, m_i, l_i


@triton.jit
def _tvt_loop(acc_t, m_i, l_i, q_t, KCache, VTCache, table_row, kv_head, start, end,
              qk_scale, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd, offs_d,
              PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if BOUNDS:
            blocks = tl.load(table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        else:
            blocks = tl.load(table_row + offs_n // PAGE_SIZE)
        blocks = blocks.to(tl.int64)
        slots = offs_n % PAGE_SIZE
        k_rows = blocks * stride_cb + slots * stride_cs + kv_head * stride_ch
        v_cols = blocks * stride_vb + kv_head * stride_vh + slots
        if BOUNDS:
            k = tl.load(KCache + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None],
                        other=0.0)
            vt = tl.load(VTCache + v_cols[None, :] + offs_d[:, None] * stride_vd,
                         mask=mask_n[None, :], other=0.0)
        else:
            k = tl.load(KCache + k_rows[:, None] + offs_d[None, :])
            vt = tl.load(VTCache + v_cols[None, :] + offs_d[:, None] * stride_vd)
        s_t = tl.dot(k.to(tl.float16), q_t) * qk_scale
        if BOUNDS:
            s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        if tl.max(m_new - m_i, 0) > LAZY_LOG2:
            alpha = tl.exp2(m_i - m_new)
            acc_t = acc_t * alpha[None, :]
            l_i = l_i * alpha
            m_i = m_new
        p_t = tl.exp2(s_t - m_i[None, :])
        acc_t = tl.dot(vt.to(tl.float16), p_t.to(tl.float16), acc_t)
        l_i = l_i + tl.sum(p_t, 0)
    return acc_t, m_i, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _tvt_kernel(Q, KCache, VTCache, BlockTables, SeqLens, Out, KVScale, qk_scale,
                stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh,
                stride_vd, stride_bt, stride_ob, stride_oh, GROUP: tl.constexpr,
                HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr):
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    end = tl.load(SeqLens + seq)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    q_t = tl.load(Q + seq * stride_qb + heads[None, :] * stride_qh + offs_d[:, None],
                  mask=mask_h[None, :], other=0.0).to(tl.float16)
    qk_scale = qk_scale * tl.load(KVScale)
    acc_t = tl.zeros([HEAD_DIM, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table_row = BlockTables + seq * stride_bt
    full_end = end // BLOCK_N * BLOCK_N
    acc_t, m_i, l_i = _tvt_loop(acc_t, m_i, l_i, q_t, KCache, VTCache, table_row, kv_head, 0,
                                full_end, qk_scale, stride_cb, stride_cs, stride_ch, stride_vb,
                                stride_vh, stride_vd, offs_d, PAGE_SIZE, BLOCK_N, False)
    acc_t, m_i, l_i = _tvt_loop(acc_t, m_i, l_i, q_t, KCache, VTCache, table_row, kv_head,
                                full_end, end, qk_scale, stride_cb, stride_cs, stride_ch,
                                stride_vb, stride_vh, stride_vd, offs_d, PAGE_SIZE, BLOCK_N, True)
    out_t = acc_t / l_i[None, :] * tl.load(KVScale + 1)
    tl.store(Out + seq * stride_ob + heads[None, :] * stride_oh + offs_d[:, None],
             out_t.to(Out.dtype.element_ty), mask=mask_h[None, :])


def tvt_decode(q, k, vt, table, lens, scale, kv_scale, out, block_n=32, num_stages=3):
    batch, heads, dim = q.shape
    kv_heads, page = k.shape[2], k.shape[1]
    _tvt_kernel[(kv_heads, batch)](
        q, k, vt, table, lens, out, kv_scale, scale * math.log2(math.e), q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), k.stride(2), vt.stride(0), vt.stride(1),
        vt.stride(2), table.stride(0), out.stride(0), out.stride(1), GROUP=heads // kv_heads,
        HEAD_DIM=dim, PAGE_SIZE=page, BLOCK_H=8, BLOCK_N=block_n, num_warps=1,
        num_stages=num_stages)
    return out


@triton.jit(do_not_specialize=["stride_bt"])
def _t_kernel(Q, KCache, VCache, BlockTables, SeqLens, Out, KVScale, qk_scale,
              stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob,
              stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, V_PTX: tl.constexpr):
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    end = tl.load(SeqLens + seq)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    q_t = tl.load(Q + seq * stride_qb + heads[None, :] * stride_qh + offs_d[:, None],
                  mask=mask_h[None, :], other=0.0).to(tl.float16)       # [HEAD_DIM, BLOCK_H]
    qk_scale = qk_scale * tl.load(KVScale)
    acc_t = tl.zeros([HEAD_DIM, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table_row = BlockTables + seq * stride_bt
    full_end = end // BLOCK_N * BLOCK_N
    acc_t, m_i, l_i = _t_loop(acc_t, m_i, l_i, q_t, KCache, VCache, table_row,
                              kv_head * stride_ch, 0, full_end, qk_scale, stride_cb, stride_cs,
                              offs_d, PAGE_SIZE, BLOCK_N, False, V_PTX)
    acc_t, m_i, l_i = _t_loop(acc_t, m_i, l_i, q_t, KCache, VCache, table_row,
                              kv_head * stride_ch, full_end, end, qk_scale, stride_cb,
                              stride_cs, offs_d, PAGE_SIZE, BLOCK_N, True, V_PTX)
    out_t = acc_t / l_i[None, :] * tl.load(KVScale + 1)
    tl.store(Out + seq * stride_ob + heads[None, :] * stride_oh + offs_d[:, None],
             out_t.to(Out.dtype.element_ty), mask=mask_h[None, :])


def t_decode(q, k, v, table, lens, scale, kv_scale, out, block_n=32, block_h=8, num_warps=1,
             num_stages=3):
    batch, heads, dim = q.shape
    kv_heads, page = k.shape[2], k.shape[1]
    _t_kernel[(kv_heads, batch)](
        q, k, v, table, lens, out, kv_scale, scale * math.log2(math.e), q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), k.stride(2), table.stride(0), out.stride(0),
        out.stride(1), GROUP=heads // kv_heads, HEAD_DIM=dim, PAGE_SIZE=page, BLOCK_H=block_h,
        BLOCK_N=block_n, V_PTX=True, num_warps=num_warps, num_stages=num_stages)
    return out


def case(batch: int, context: int, rows: list, vt: bool = False) -> None:
    heads, kv_heads, dim, page = 32, 8, 128, 16
    blocks = batch * (context // page) + 1
    k = torch.randn(blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks - 1, device="cuda", dtype=torch.int32)[
        :batch * (context // page)].view(batch, -1)
    lens = torch.full((batch,), context - 3, device="cuda", dtype=torch.int32)  # a ragged tile
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_scale = torch.tensor([0.02, 0.02], device="cuda")
    k8, v8 = (k / 0.02).to(torch.float8_e4m3fn), (v / 0.02).to(torch.float8_e4m3fn)
    ref = decode_attention_ref(q, k8, v8, table, lens, dim ** -0.5, kv_scale).float()
    nbytes = 2 * batch * context * kv_heads * dim

    def row(name, fn, **knobs):
        fn()
        err = (out.float() - ref).abs().max().item()
        ms = triton.testing.do_bench(fn)
        rows.append({"batch": batch, "context": context, "kernel": name, "us": ms * 1e3,
                     "GBps": nbytes / ms / 1e6, "max_abs_err": err, **knobs})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    row("shipped_fp8", lambda: decode_attention(q, k8, v8, table, lens, dim ** -0.5, context,
                                                out=out, kv_scale=kv_scale))
    if vt:                      # transposed, over V pages stored transposed, against shipped
        vt8 = v8.permute(0, 2, 3, 1).contiguous()
        for block_n in (16, 32):
            row("transposed_vt_fp8", lambda: tvt_decode(q, k8, vt8, table, lens, dim ** -0.5,
                                                        kv_scale, out, block_n),
                block_n=block_n)
        return
    for block_n, block_h, warps, stages in ((32, 8, 1, 3), (32, 4, 1, 3), (64, 8, 1, 3),
                                            (64, 8, 2, 3), (32, 8, 1, 4), (16, 8, 1, 3)):
        row("transposed_fp8", lambda: t_decode(q, k8, v8, table, lens, dim ** -0.5, kv_scale,
                                               out, block_n, block_h, warps, stages),
            block_n=block_n, block_h=block_h, num_warps=warps, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x1024,128x1024,256x1024,64x2048,128x2048,256x2048")
    ap.add_argument("--vt", action="store_true", help="over V pages stored transposed")
    args = ap.parse_args()
    rows: list = []
    for c in args.cases.split(","):
        case(*map(int, c.split("x")), rows, args.vt)
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
