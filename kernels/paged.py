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
and softmax stay fp32), V's multiplied into the finished output (`load_kv_scales`), unless
the output is itself fp8 (`finish_output`: the FP8 o projection's input, with V's scale as
its per-token scale, so no quantization kernel runs between attention and that GEMM).
Reading fp8 KV halves the bytes a decode streams but not its time: widening the tiles costs
instructions, so the fp8 paths below are shaped to spend as few of them as they can.

Where V is widened matters. Left to Triton, `.to(float16)` of the V tile is moved past the
shared-memory copy that turns it into the P @ V dot's B operand, and fp8 bytes are then read
from shared memory one or two at a time and permuted (V's rows run along head_dim, the
dot's reduction runs along tokens; ldmatrix can transpose 16-bit values only). Widening in
the load's own layout (`widen_e4m3` with PTX, an instruction Triton does not move) stores
fp16 to shared memory and reads it back with ldmatrix, as a 16-bit cache does. K's tile is
left to Triton: widening it by PTX as well made the kernel slower.
V is widened four e4m3 per inline-asm call, from the 32-bit register that holds them: with two
per call Triton rebuilds each pair from single bytes (a PRMT, a shift and an OR per value).

One-warp fp8 decode programs are latency-bound, not bandwidth-bound: with one K/V tile in
flight each waits on its loads. Triton gives a load whose address comes from another load
(the page table) a second shared-memory buffer only from num_stages 5, hence
kernels/decode_attention.py ONE_WARP_STAGES. They also compute transposed
(`attend_paged_range_t`): the query group as the dots' N dimension halves their MMAs and
accumulator. Masks on the ragged last tile only and the lazy rescale (`attend_paged_range`
LAZY) keep the loop short.

The designs measured and not kept (FP8 tensor cores for either dot, the whole loop on wgmma,
K widened by PTX too, V pages stored transposed, int32-word loads, head-major or larger pages,
a register double buffer) and the figures behind every choice here are logged in
bench/results/README.md as of commit 6987296 (the index is generated from the results since).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import fp8_math

FP8_MAX = tl.constexpr(fp8_math.FP8_MAX)    # stores and fp8 outputs saturate to it
LAZY_LOG2 = tl.constexpr(8.0)   # `attend_paged_range` LAZY: rescale once a max grows 256x


def check_kv_dtype(q: torch.Tensor, k_cache: torch.Tensor, kv_scale: torch.Tensor | None):
    """A launcher's check: the cache is in q's dtype (kv_scale None), or float8_e4m3fn with
    its [K scale, V scale] float32 tensor on the cache's device."""
    if kv_scale is None:
        assert q.dtype == k_cache.dtype, f"KV cache {k_cache.dtype} for q {q.dtype}"
        return
    assert k_cache.dtype == torch.float8_e4m3fn, f"kv_scale given for a {k_cache.dtype} cache"
    assert kv_scale.dtype == torch.float32 and kv_scale.numel() >= 2 \
        and kv_scale.device == k_cache.device and kv_scale.stride(-1) == 1


@functools.lru_cache(maxsize=None)
def widen_by_ptx(device: torch.device) -> bool:
    """Whether kernels on `device` may widen e4m3 by PTX (`widen_e4m3`): a CUDA GPU of
    compute capability 8.9 or later, where the instruction exists."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_out_dtype(out: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """A launcher's check of its `out`: True for an fp8 output (`finish_output`), which only an
    fp8 cache can give (the values are in V's units)."""
    fp8_out = out.dtype == torch.float8_e4m3fn
    assert not fp8_out or kv_scale is not None, "an fp8 output needs an fp8 KV cache"
    return fp8_out


@triton.jit
def finish_output(out, v_scale, OUT_FP8: tl.constexpr):
    """A finished output tile `out` (acc / l, float32) in its output's units: values (times
    V's scale), or for an fp8 output, the FP8 o projection's input, V's own units. Each output
    row is a convex mix of V's e4m3 rows, so it lies within +-448 and the static V scale
    quantizes it as well as a per-token scale would, with no reduction over the row; the clamp
    only catches float32 rounding at the edge (torch's cast would turn 448.00003 into NaN)."""
    if OUT_FP8:
        out = tl.minimum(tl.maximum(out, -FP8_MAX), FP8_MAX)
    else:
        out = out * v_scale
    return out


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
def widen_e4m3(x, PTX: tl.constexpr):
    """An e4m3 tile in float16 (exact). PTX: by cvt.rn.f16x2.e4m3x2 in inline assembly,
    marked impure so Triton keeps it in the load's layout (module docstring); the
    interpreter and pre-sm89 GPUs cannot run it, so launchers pass PTX only on sm89+."""
    if PTX:
        x = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r",
            [x.to(tl.int8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        x = x.to(tl.float16)
    return x


@triton.jit
def load_kv_tile(KCache, VCache, table_row, head_offset, n0, end, stride_block, stride_slot,
                 offs_d, mask_d, DTYPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, V_PTX: tl.constexpr):
    """The K and V tiles [BLOCK_N, BLOCK_D] of positions n0 .. n0 + BLOCK_N of one sequence
    (0 past `end`) in DTYPE, the dots' dtype: fp8 tiles are widened (callers pass q as
    float16 then, see dot_dtype; V by `widen_e4m3` with V_PTX), a cache in q's dtype is as
    loaded. Also returns the positions and their mask (< end)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    rows = head_offset + paged_token_offsets(table_row, offs_n, mask_n, stride_block,
                                             stride_slot, PAGE_SIZE)
    ptrs = rows[:, None] + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(KCache + ptrs, mask=kv_mask, other=0.0).to(DTYPE)
    v = tl.load(VCache + ptrs, mask=kv_mask, other=0.0)
    if V_PTX:
        v = widen_e4m3(v, True)
    else:
        v = v.to(DTYPE)
    return k, v, offs_n, mask_n


@triton.jit
def attend_paged_range(acc, m_i, l_i, q, q_pos, KCache, VCache, table_row, head_offset,
                       start, end, qk_scale, stride_block, stride_slot, offs_d, mask_d,
                       PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr,
                       CAUSAL: tl.constexpr, V_PTX: tl.constexpr = False,
                       LAZY: tl.constexpr = False):
    """Online-softmax attention of q [M, BLOCK_D] to positions [start, end) of one sequence.

    acc [M, BLOCK_D] (unnormalised output), m_i [M] (running max), l_i [M] (running sum)
    are carried in and returned. BOUNDS masks scores past `end` (a ragged last tile); CAUSAL
    lets row r see only positions <= q_pos[r]; with neither, every tile must be full.
    V_PTX: an fp8 V tile is widened by `widen_e4m3` with PTX.
    Each K/V tile is loaded once for all M rows: for decode the rows are the query heads of
    one KV head's group, which is how GQA reads the cache once per group.
    """
    for n0 in range(start, end, BLOCK_N):
        k, v, offs_n, mask_n = load_kv_tile(KCache, VCache, table_row, head_offset, n0, end,
                                            stride_block, stride_slot, offs_d, mask_d,
                                            q.dtype, PAGE_SIZE, BLOCK_N, V_PTX)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if BOUNDS:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
        if CAUSAL:
            qk = tl.where(offs_n[None, :] <= q_pos[:, None], qk, float("-inf"))
        # Callers ensure each row has seen a position by the end of its first tile, so
        # m_new stays finite (no -inf - -inf = NaN).
        if LAZY:
            acc, m_i, l_i = lazy_softmax_tile(acc, m_i, l_i, qk, v)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def lazy_softmax_tile(acc, m_i, l_i, qk, v):
    """One tile of an online softmax, rows = query heads: scores qk [rows, n] (log2 units),
    values v [n, d] into acc [rows, d], running max m_i and sum l_i [rows].

    Rescales only once some row's max has grown past LAZY_LOG2 since the last time: p then
    stays below 2 ** LAZY_LOG2 (exact in fp16 and fp32), and the tiles in between skip the
    acc * alpha multiplies (a quarter of a tile's float work)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if tl.max(m_new - m_i, 0) > LAZY_LOG2:
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(qk - m_i[:, None])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i + tl.sum(p, 1)


@triton.jit
def attend_paged_range_t(acc_t, m_i, l_i, q_t, KCache, VCache, table_row, head_offset, start,
                         end, qk_scale, stride_block, stride_slot, offs_d, mask_d,
                         PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS: tl.constexpr,
                         V_PTX: tl.constexpr = False):
    """`attend_paged_range` (LAZY, no CAUSAL) with the query rows as the dots' N dimension:
    S^T = K q^T [BLOCK_N, M] and O^T = V^T P^T, so q_t is [BLOCK_D, M] and acc_t
    [BLOCK_D, M]; m_i and l_i are [M].

    An mma.sync tile is 16 rows by 8 columns: a group of 4 query heads as rows fills a
    quarter of each tile, as columns half. A one-warp decode program then needs half the
    MMAs, half the accumulator registers and half the softmax work (168 registers a thread
    against 226), so more programs fit an SM (kernels/decode_attention.py `one_warp`).
    """
    for n0 in range(start, end, BLOCK_N):
        k, v, offs_n, mask_n = load_kv_tile(KCache, VCache, table_row, head_offset, n0, end,
                                            stride_block, stride_slot, offs_d, mask_d,
                                            q_t.dtype, PAGE_SIZE, BLOCK_N, V_PTX)
        s_t = tl.dot(k, q_t) * qk_scale
        if BOUNDS:
            s_t = tl.where(mask_n[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        if tl.max(m_new - m_i, 0) > LAZY_LOG2:     # as lazy_softmax_tile, transposed
            alpha = tl.exp2(m_i - m_new)
            acc_t = acc_t * alpha[None, :]
            l_i = l_i * alpha
            m_i = m_new
        p_t = tl.exp2(s_t - m_i[None, :])
        acc_t = tl.dot(tl.trans(v), p_t.to(v.dtype), acc_t)
        l_i = l_i + tl.sum(p_t, 0)
    return acc_t, m_i, l_i

