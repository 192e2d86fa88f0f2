"""Experiment: decode attention over an FP8 (e4m3) paged cache, kernel variants side by side
(Llama-3.1-8B attention: 32 query heads, 8 KV heads, head_dim 128, block 16), against the
shipped kernel over bf16 and fp8 caches. Prints one JSON object, and streams each row to
stderr as a JSON line as it is measured (a variant that faults the GPU ends the process, so
run suspects one per process with --variants).

    PYTHONPATH=. python bench/decode_fp8_variants.py [--variants v_asm,f16] \
        [--cases 64x1024,256x1024] [--quick] [--no-shipped] [--load-only]

Variants of one stage-1 program (one KV head's query group against a whole context; no
split), all reading the same cache (`VARIANTS` names them):
    f16          the shipped kernel's math before V_PTX: both tiles widened by `.to(float16)`
    v_asm        V widened by PTX in the load's layout (kernels/paged.py widen_e4m3): shipped
    kv_asm       K too
    qk8_swapped  q quantized per head to e4m3, scores as K @ q^T on FP8 tensor cores (wgmma,
                 no K widening); `_v_asm` with V widened by PTX
    *_pv8_*      p scaled by 448 into e4m3, P @ V on FP8 tensor cores (V transposed)
    transposed   the whole loop on S^T and O^T; `split` adds q's (and p's) e4m3 rounding
                 error as a second FP8 dot; `_v_asm` widens V by PTX (both dots on wgmma)
    f16_prefetch the next tile's K and V loaded before this tile's math (register double buffer)
The fp16 P @ V on swapped operands (`*_pv16_swapped`, `transposed_pv16`,
`transposed_split_pv16`) faulted the GPU under Triton 3.6 (illegal address), so they are left
out of the default list. --load-only times the reads alone (the floor any variant can reach)
on the paged layout and on one with each KV head's page rows side by side.
Times are medians of triton.testing.do_bench; GB/s counts the K and V bytes read. Each row
also gives the max abs error against the fp32 reference of the fp8 cache.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.paged import widen_e4m3  # noqa: E402


@triton.jit
def _tile(KCache, VCache, table_row, head_offset, n0, end, stride_cb, stride_cs, offs_d,
          PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    blocks = tl.load(table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    rows = head_offset + blocks * stride_cb + (offs_n % PAGE_SIZE) * stride_cs
    ptrs = rows[:, None] + offs_d[None, :]
    k = tl.load(KCache + ptrs, mask=mask_n[:, None], other=0.0)
    v = tl.load(VCache + ptrs, mask=mask_n[:, None], other=0.0)
    return k, v, mask_n


@triton.jit(do_not_specialize=["stride_bt"])
def _load_only_kernel(KCache, VCache, BlockTables, SeqLens, Out, stride_cb, stride_cs, stride_ch,
                      stride_bt, PAGE_SIZE: tl.constexpr, WORDS: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """The stage-1 program's reads and nothing else: the K and V rows of one KV head of one
    sequence as int32 words (strides in words), xor-reduced so nothing is optimised away."""
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    end = tl.load(SeqLens + seq)
    offs_w = tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], dtype=tl.int32)
    table_row = BlockTables + seq * stride_bt
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blocks = tl.load(table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        rows = kv_head * stride_ch + blocks * stride_cb + (offs_n % PAGE_SIZE) * stride_cs
        ptrs = rows[:, None] + offs_w[None, :]
        k = tl.load(KCache + ptrs, mask=mask_n[:, None], other=0)
        v = tl.load(VCache + ptrs, mask=mask_n[:, None], other=0)
        acc = acc ^ tl.xor_sum(k ^ v, 0)
    tl.store(Out + (seq * tl.num_programs(0) + kv_head) * WORDS + offs_w, acc)


def load_only(k, v, table, lens, out_words, block_n=128, num_warps=4, num_stages=1):
    kw, vw = k.view(torch.int32), v.view(torch.int32)
    _load_only_kernel[(k.shape[2], table.shape[0])](
        kw, vw, table, lens, out_words, kw.stride(0), kw.stride(1), kw.stride(2), table.stride(0),
        PAGE_SIZE=k.shape[1], WORDS=kw.shape[3], BLOCK_N=block_n, num_warps=num_warps,
        num_stages=num_stages)


@triton.jit
def _transposed_loop(q_t, q_lo_t, row_scale, lo_scale, KCache, VCache, table_row, head_offset,
                     end, stride_cb, stride_cs, offs_d, PAGE_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                     PV_FP8: tl.constexpr, SPLIT: tl.constexpr, V_ASM: tl.constexpr):
    acc_t = tl.zeros([HEAD_DIM, BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        k, v, mask_n = _tile(KCache, VCache, table_row, head_offset, n0, end, stride_cb,
                             stride_cs, offs_d, PAGE_SIZE, BLOCK_N)
        s_t = tl.dot(k, q_t) * row_scale[None, :]             # [BLOCK_N, BLOCK_H]
        if SPLIT:   # q's e4m3 rounding error, itself in e4m3: ~7 significant bits in all
            s_t += tl.dot(k, q_lo_t) * lo_scale[None, :]
        s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        if PV_FP8:
            p_hi = (p_t * 448.0).to(tl.float8e4nv)
            pv = tl.dot(tl.trans(v), p_hi) * (1.0 / 448.0)
            if SPLIT:
                p_lo = ((p_t * 448.0 - p_hi.to(tl.float32)) * 16.0).to(tl.float8e4nv)
                pv += tl.dot(tl.trans(v), p_lo) * (1.0 / 448.0 / 16.0)
        else:
            pv = tl.dot(tl.trans(widen_e4m3(v, V_ASM)), p_t.to(tl.float16))
        acc_t = acc_t * alpha[None, :] + pv
        l_i = l_i * alpha + tl.sum(p_t, 0)
        m_i = m_new
    return acc_t, m_i, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _variant_kernel(Q, KCache, VCache, BlockTables, SeqLens, Out, KVScale, qk_scale,
                    stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
                    stride_ob, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, QK_FP8: tl.constexpr,
                    PV_FP8: tl.constexpr, PREFETCH: tl.constexpr, SWAP_QK: tl.constexpr,
                    SWAP_PV: tl.constexpr, TRANSPOSED: tl.constexpr,
                    SPLIT: tl.constexpr, V_ASM: tl.constexpr, K_ASM: tl.constexpr):
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    end = tl.load(SeqLens + seq)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0).to(tl.float32)
    qk_scale = qk_scale * tl.load(KVScale)
    v_scale = tl.load(KVScale + 1)
    if QK_FP8:
        q_scale = tl.maximum(tl.max(tl.abs(q), axis=1) / 448.0, 1e-12)
        qd = (q / q_scale[:, None]).to(tl.float8e4nv)
        row_scale = q_scale * qk_scale
        lo_scale = q_scale / 16.0
        q_lo = ((q / q_scale[:, None] - qd.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        lo_scale = lo_scale * qk_scale
    else:
        qd = q.to(tl.float16)
        row_scale = tl.zeros([BLOCK_H], dtype=tl.float32) + qk_scale
        q_lo, lo_scale = qd, row_scale
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table_row = BlockTables + seq * stride_bt
    head_offset = kv_head * stride_ch
    k, v, mask_n = _tile(KCache, VCache, table_row, head_offset, 0, end, stride_cb,
                         stride_cs, offs_d, PAGE_SIZE, BLOCK_N)
    if TRANSPOSED:      # the whole loop on S^T [tokens, heads] and O^T [D, heads]
        acc_t, m_i, l_i = _transposed_loop(
            tl.trans(qd), tl.trans(q_lo), row_scale, lo_scale, KCache, VCache, table_row,
            head_offset, end, stride_cb, stride_cs, offs_d, PAGE_SIZE, BLOCK_N, BLOCK_H,
            HEAD_DIM, PV_FP8, SPLIT, V_ASM)
        acc = tl.trans(acc_t)
    for n0 in range(0, end if not TRANSPOSED else 0, BLOCK_N):
        if PREFETCH:
            k_cur, v_cur, mask_cur = k, v, mask_n
            k, v, mask_n = _tile(KCache, VCache, table_row, head_offset, n0 + BLOCK_N, end,
                                 stride_cb, stride_cs, offs_d, PAGE_SIZE, BLOCK_N)
        else:
            k_cur, v_cur, mask_cur = _tile(KCache, VCache, table_row, head_offset, n0, end,
                                           stride_cb, stride_cs, offs_d, PAGE_SIZE, BLOCK_N)
        if SWAP_QK:     # K tile as wgmma's M operand (tokens x D), q^T as N: native fp8
            qk = tl.trans(tl.dot(k_cur, tl.trans(qd)))
        elif QK_FP8:
            qk = tl.dot(qd, tl.trans(k_cur))
        elif K_ASM:
            qk = tl.dot(qd, tl.trans(widen_e4m3(k_cur, True)))
        else:
            qk = tl.dot(qd, tl.trans(k_cur.to(tl.float16)))
        qk = tl.where(mask_cur[None, :], qk * row_scale[:, None], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        if SWAP_PV:     # V^T as wgmma's M operand (D x tokens), P^T as N
            if PV_FP8:
                pv = tl.trans(tl.dot(tl.trans(v_cur), tl.trans((p * 448.0).to(tl.float8e4nv))))
                pv = pv * (1.0 / 448.0)
            else:
                pv = tl.trans(tl.dot(tl.trans(v_cur.to(tl.float16)),
                                     tl.trans(p.to(tl.float16))))
        elif PV_FP8:
            pv = tl.dot((p * 448.0).to(tl.float8e4nv), v_cur) * (1.0 / 448.0)
        elif V_ASM:
            pv = tl.dot(p.to(tl.float16), widen_e4m3(v_cur, True))
        else:
            pv = tl.dot(p.to(tl.float16), v_cur.to(tl.float16))
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / l_i[:, None] * v_scale
    tl.store(Out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_h[:, None])


def variant(q, k, v, table, lens, scale, kv_scale, out, block_n=128, num_warps=4,
            num_stages=1, qk_fp8=False, pv_fp8=False, prefetch=False, swap_qk=False,
            swap_pv=False, transposed=False, split=False, v_asm=False, k_asm=False):
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    _variant_kernel[(kv_heads, batch)](
        q, k, v, table, lens, out, kv_scale, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), table.stride(0),
        out.stride(0), out.stride(1), GROUP=heads // kv_heads, HEAD_DIM=dim,
        PAGE_SIZE=k.shape[1], BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_N=block_n, QK_FP8=qk_fp8 or swap_qk or transposed, PV_FP8=pv_fp8, PREFETCH=prefetch,
        SWAP_QK=swap_qk, SWAP_PV=swap_pv, TRANSPOSED=transposed,
        SPLIT=split, V_ASM=v_asm, K_ASM=k_asm,
        num_warps=num_warps, num_stages=num_stages)
    return out


VARIANTS = {
    "f16": {}, "f16_prefetch": {"prefetch": True},
    "qk8_swapped": {"swap_qk": True},
    "qk8_swapped_pv16_swapped": {"swap_qk": True, "swap_pv": True},
    "qk8_swapped_pv8_swapped": {"swap_qk": True, "swap_pv": True, "pv_fp8": True},
    "transposed_pv16": {"transposed": True},
    "transposed_pv8": {"transposed": True, "pv_fp8": True},
    "transposed_split_pv16": {"transposed": True, "split": True},
    "v_asm": {"v_asm": True}, "kv_asm": {"v_asm": True, "k_asm": True},
    "qk8_swapped_v_asm": {"swap_qk": True, "v_asm": True},
    "transposed_v_asm": {"transposed": True, "v_asm": True},
    "transposed_split_pv8": {"transposed": True, "pv_fp8": True, "split": True},
}

FAULTING = ("qk8_swapped_pv16_swapped", "transposed_pv16", "transposed_split_pv16")


def reference(q, k, v, table, lens, scale, kv_scale):
    """fp32 attention over the dequantized cache (every sequence full, blocks in order)."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    kk = (k.float() * kv_scale[0]).view(batch, -1, kv_heads, dim)
    vv = (v.float() * kv_scale[1]).view(batch, -1, kv_heads, dim)
    kk = kk.repeat_interleave(heads // kv_heads, dim=2)
    vv = vv.repeat_interleave(heads // kv_heads, dim=2)
    s = torch.einsum("bhd,bnhd->bhn", q.float(), kk) * scale
    return torch.einsum("bhn,bnhd->bhd", s.softmax(-1), vv)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x1024,128x1024,256x1024,64x2048,128x2048")
    ap.add_argument("--quick", action="store_true", help="one knob setting per variant")
    ap.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in FAULTING),
                    help="comma-separated names; a variant that faults the GPU stops the run, "
                    "so run suspects one per process")
    ap.add_argument("--load-only", action="store_true", help="the reads alone, and a layout "
                    "with each KV head's page rows side by side")
    ap.add_argument("--no-shipped", action="store_true", help="skip the shipped kernel's rows")
    args = ap.parse_args()
    heads, kv_heads, dim, block = 32, 8, 128, 16
    rows = []
    for batch, context in (tuple(map(int, c.split("x"))) for c in args.cases.split(",")):
        blocks = batch * context // block
        kb = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        vb = torch.randn_like(kb)
        kv_scale = torch.tensor([0.05, 0.05], device="cuda")
        k8, v8 = (kb / 0.05).to(torch.float8_e4m3fn), (vb / 0.05).to(torch.float8_e4m3fn)
        table = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        scale = dim ** -0.5
        ref = reference(q[:8], k8[:8 * context // block], v8[:8 * context // block],
                        table[:8], lens[:8], scale, kv_scale)
        fp8_bytes = 2 * k8.numel()

        def timed(name, fn, nbytes, **knobs):
            print(json.dumps({"trying": name, "batch": batch, "context": context, **knobs}),
                  file=sys.stderr, flush=True)
            try:
                ms = triton.testing.do_bench(fn)
            except Exception as e:      # a variant Triton cannot compile: say so, go on
                rows.append({"batch": batch, "context": context, "variant": name,
                             "error": f"{type(e).__name__}: {str(e)[:200]}", **knobs})
                return
            row = {"batch": batch, "context": context, "variant": name, "ms": ms,
                   "GBps": nbytes / ms / 1e6, **knobs}
            if name not in ("shipped_bf16", "load_only", "load_only_bf16", "load_only_head_pages",
                            "f16_head_pages"):
                row["max_abs_err"] = float((out[:8].float() - ref).abs().max())
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)   # survives a later fault

        if not args.no_shipped:
            timed("shipped_bf16", lambda: decode_attention(
                q, kb, vb, table, lens, scale, context, out=out), 2 * kb.numel() * 2)
            timed("shipped_fp8", lambda: decode_attention(
                q, k8, v8, table, lens, scale, context, out=out, kv_scale=kv_scale), fp8_bytes)
        kb = vb = None      # free the bf16 caches for the variants
        if args.load_only:
            words = torch.empty(batch * kv_heads * 64, dtype=torch.int32, device="cuda")
            # one KV head per "sequence": each page's rows of a head lie side by side
            k1 = k8.permute(0, 2, 1, 3).reshape(blocks * kv_heads, block, 1, dim)
            v1 = v8.permute(0, 2, 1, 3).reshape(blocks * kv_heads, block, 1, dim)
            table1 = torch.arange(blocks * kv_heads, device="cuda", dtype=torch.int32).view(
                batch, -1, kv_heads).transpose(1, 2).reshape(batch * kv_heads, -1)
            lens1 = torch.full((batch * kv_heads,), context, device="cuda", dtype=torch.int32)
            q1 = q.view(batch * kv_heads, heads // kv_heads, dim)
            out1 = torch.empty_like(q1)
            kb, vb = (torch.zeros(blocks, block, kv_heads, dim, device="cuda",
                                  dtype=torch.bfloat16) for _ in range(2))
            for bn, w in itertools.product((64, 128, 256), (4, 8)):
                knobs = dict(block_n=bn, num_warps=w)
                timed("load_only_bf16", lambda: load_only(kb, vb, table, lens, words, **knobs),
                      2 * fp8_bytes, **knobs)
                timed("load_only", lambda: load_only(k8, v8, table, lens, words, **knobs),
                      fp8_bytes, **knobs)
                timed("load_only_head_pages", lambda: load_only(k1, v1, table1, lens1, words,
                                                                **knobs), fp8_bytes, **knobs)
                timed("f16_head_pages", lambda: variant(q1, k1, v1, table1, lens1, scale,
                                                        kv_scale, out1, num_stages=3, **knobs),
                      fp8_bytes, **knobs)
            continue
        grid = ([(128, 4, 1)] if args.quick else
                list(itertools.product((64, 128, 256), (4, 8), (1, 3))))
        for name in args.variants.split(","):
            flags = VARIANTS[name]
            for bn, w, st in grid:
                knobs = dict(block_n=bn, num_warps=w, num_stages=st)
                timed(name, lambda: variant(q, k8, v8, table, lens, scale, kv_scale, out,
                                            **flags, **knobs), fp8_bytes, **knobs)
    best = {}
    for r in rows:
        if "ms" in r:
            key = (r["batch"], r["context"], r["variant"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    print(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                      "best": list(best.values()), "all": rows}, indent=1))


if __name__ == "__main__":
    main()
