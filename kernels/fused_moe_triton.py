"""kernels/fused_moe.py's MoE experts on the GPU: one grouped-GEMM Triton kernel, launched for
gate/up and again for down, then a kernel that sums each token's K products.

    x             [T, H]        bf16 or fp16 (fp32 works; it is what the CPU tests run)
    w13           [E, 2I, H]    contiguous; or float8_e4m3fn with w13_scale [E, 2I] float32
    w2            [E, H, I]     contiguous; or float8_e4m3fn with w2_scale [E, H] float32
    topk_weights  [T, K]        contiguous, any float dtype
    topk_ids      [T, K]        contiguous, global ids; local expert e is first_expert + e
    out           [T, H]        x's dtype (kernels/fused_moe.py's contract)

The steps, all on the device with no host sync (a CUDA graph captures them; every shape
depends on T, K, E and the tiles alone):
 1. kernels/moe_align.py sorts the T*K (token, slot) pairs by local expert into runs padded to
    BLOCK_M rows, and names each block's expert (-1: no work; pairs of other ranks' experts
    are dropped there): one Triton program for a decode batch, torch's sort for more.
 2. gate_up [T*K, 2I] = x[p // K] @ w13[e].T for each pair p: a program owns BLOCK_M sorted
    rows (all of one expert, so one weight tile serves them) and BLOCK_N output columns.
    Row blocks vary fastest in the grid, so that the programs reading one expert's weight
    tile run together and it comes from memory once.
 3. kernels/activation.py's silu_and_mul: h [T*K, I] = silu(gate) * up, over all T*K rows
    (under expert parallelism most are other ranks' pairs, computed from unwritten memory
    and never read: wasted, but small beside the GEMMs).
 4. y [T*K, H] = h[p] @ w2[e].T, the same kernel.
 5. out[t] = the sum over t's local slots of y[t*K + k] * topk_weights[t, k]: each product and
    each partial sum rounded to x's dtype, added in ascending expert order, as the reference
    adds them. The rows of slots outside the local range are never read (nor written), so no
    buffer is zeroed.

Rounding: every step rounds where the reference does (gate_up, silu, h, y, the weighted
product and each partial sum in the model dtype); what differs is only the order in which a
GEMM adds up its float32 products (cuBLAS's against this kernel's), so in bf16 an element of
gate_up or y can be one bf16 ulp off, and out then differs by about that (expected: a few
1e-3 relative; unmeasured, the GPU test allows 1e-2). Agreement within float32 rounding is
for fp32 (the CPU tests: 1e-5 relative).

FP8 experts (W8A8, as the project's dense FP8 layers: pd_cluster/models/fp8.py): x is
quantized per token (kernels/fp8_quant.py) and h by silu_and_mul itself, each row with one
dynamic scale; both GEMMs multiply e4m3 by e4m3 on the FP8 tensor cores and scale their
float32 accumulator by the row's scale and the output channel's. Chosen over dequantizing the
weights in the kernel (W8A16) because the existing pieces do all of it and kernels/fp8_linear.py
measured W8A16 1.3-2.1x slower on a dense GEMM; kernels/fused_moe.py's reference does the same
quantization.

Unmeasured (written without a GPU): the tiles (`tiles`, first guesses), the speed against
the bytes it must read, and the cost of the sort (moe_align's one launch, or its forty small
torch launches past ONE_LAUNCH_MAX_PAIRS); bench/moe_bench.py measures them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.fp8_math import FP8
from kernels.fp8_quant import per_token_quant
from kernels.moe_align import align
from kernels.pdl import pdl_args, wait_for_inputs

SUM_BLOCK = 1024        # the sum kernel's columns per program


@dataclass(frozen=True)
class Tiles:
    """One GEMM's launch: rows (sorted pairs) x output columns x depth per program, its warps
    and its software-pipelining depth."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def tiles(pairs: int, experts: int, n: int, k: int, fp8: bool = False) -> Tiles:
    """First guesses (unmeasured) for a GEMM of `pairs` (T * K) rows over `experts` local
    experts, n output columns and depth k. BLOCK_M follows the rows an expert gets on average
    (uniform routing): a decode batch gives each expert a few rows, and a 64-row tile would
    be mostly padding; a prefill fills wide tiles. Few rows stream the weight, so narrow deep
    tiles give more programs; FP8 elements are half the bytes, so a tile goes twice as deep
    for the same shared memory."""
    per_expert = pairs / experts
    if per_expert <= 32:
        block_m, block_n, block_k = (16 if per_expert <= 16 else 32), 64, 128
    else:
        block_m, block_n, block_k = 64, 128, 64
    block_k *= 2 if fp8 else 1
    # Shallow layers (a small I on a tensor-parallel rank) take one step; 32 is the
    # smallest depth an FP8 tensor-core dot takes.
    return Tiles(block_m, block_n, max(32, min(block_k, triton.next_power_of_2(k))))


@triton.jit
def _moe_gemm_kernel(A, B, C, SortedIds, ExpertIds, AScale, BScale, N, K, pairs,
                     stride_am, stride_be, stride_bn, stride_cm, stride_bse,
                     PAIRS_PER_ROW: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """C[p] = A[p // PAIRS_PER_ROW] @ B[e].T for the pairs p of sorted block program_id(0),
    all of expert e. PAIRS_PER_ROW is K when A is x (one row per token) and 1 when A is h.
    SCALED: A and B are FP8, and the float32 accumulator is multiplied by AScale [rows] (the
    row's) and BScale [E, N] (the column's)."""
    wait_for_inputs(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ExpertIds + pid_m)
    if expert < 0:      # past the last expert's run
        return
    pair = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pair < pairs       # the padding's sentinel is `pairs`
    row = pair // PAIRS_PER_ROW
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    a_ptrs = A + row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = (B + expert.to(tl.int64) * stride_be + offs_n[:, None].to(tl.int64) * stride_bn
              + offs_k[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        # ieee: fp32 operands (the CPU tests') multiply exactly, not in TF32; 16-bit and FP8
        # operands are unaffected.
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    if SCALED:
        a_scale = tl.load(AScale + row, mask=mask_m, other=0.0)
        b_scale = tl.load(BScale + expert * stride_bse + offs_n, mask=mask_n, other=0.0)
        acc = acc * a_scale[:, None] * b_scale[None, :]
    c_ptrs = C + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_sum_kernel(Y, TopkIds, TopkWeights, Out, first_expert, num_experts, H, stride_out,
                    TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_H: tl.constexpr,
                    PDL: tl.constexpr):
    """Out[t] = sum of Y[t * TOP_K + k] * TopkWeights[t, k] over the slots k of token t
    (program_id(0)) whose expert is local, in the reference's order and rounding (module
    docstring, step 5)."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    slots = tl.arange(0, K_POW2)
    in_k = slots < TOP_K
    ids = tl.load(TopkIds + token * TOP_K + slots, mask=in_k, other=0) - first_expert
    local = in_k & (ids >= 0) & (ids < num_experts)
    weights = tl.load(TopkWeights + token * TOP_K + slots, mask=in_k, other=0.0)
    weights = weights.to(Out.dtype.element_ty).to(tl.float32)
    # A local slot's rank: the local slots added before it, those of smaller expert ids, so
    # that they are added in the reference's order (a tie, which a top-k never makes, goes
    # by slot: the ranks stay distinct).
    earlier = ((ids[None, :] < ids[:, None])
               | ((ids[None, :] == ids[:, None]) & (slots[None, :] < slots[:, None])))
    rank = tl.sum((earlier & local[None, :]).to(tl.int32), axis=1)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        this = local & (rank == r)      # one slot, or none past the token's local slots
        width = tl.sum(this.to(tl.int32), axis=0) * H       # H, or 0: nothing to read
        slot = tl.sum(tl.where(this, slots, 0), axis=0)
        weight = tl.sum(tl.where(this, weights, 0.0), axis=0)
        y = tl.load(Y + (token * TOP_K + slot) * H + offs_h, mask=offs_h < width, other=0.0)
        # Both roundings as torch's: a product of two model-dtype values is exact in float32.
        product = (y.to(tl.float32) * weight).to(Out.dtype.element_ty)
        acc = (acc + product.to(tl.float32)).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + token * stride_out + offs_h, acc.to(Out.dtype.element_ty), mask=mask_h)


def _grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                  w_scale: torch.Tensor | None, c: torch.Tensor, sorted_ids: torch.Tensor,
                  expert_ids: torch.Tensor, pairs_per_row: int, cfg: Tiles) -> None:
    """c[p] = a[p // pairs_per_row] @ w[e].T (scaled, for FP8) into c [T*K, N]."""
    n, k = w.shape[1], w.shape[2]
    grid = (expert_ids.shape[0], triton.cdiv(n, cfg.block_n))
    # Unscaled: the scale pointers are never read; a stands in.
    _moe_gemm_kernel[grid](a, w, c, sorted_ids, expert_ids,
                           a if a_scale is None else a_scale, a if w_scale is None else w_scale,
                           n, k, c.shape[0], a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                           0 if w_scale is None else w_scale.stride(0),
                           PAIRS_PER_ROW=pairs_per_row, SCALED=a_scale is not None,
                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                           **pdl_args(a.device))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int = 0,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              config: tuple[Tiles, Tiles] | None = None) -> torch.Tensor:
    """kernels/fused_moe.py's `out` (module docstring). FP8 experts: w13 and w2 in e4m3 with
    their scales. `config` (gate/up's tiles, down's; one BLOCK_M) is a tuning knob: it
    defaults to `tiles`."""
    tokens, hidden = x.shape
    experts, two_inter = w13.shape[0], w13.shape[1]
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    fp8 = w13_scale is not None
    assert x.stride(-1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    assert w13.shape[2] == hidden and w2.shape == (experts, hidden, two_inter // 2)
    assert topk_ids.is_contiguous() and topk_weights.is_contiguous()
    assert topk_weights.shape == topk_ids.shape == (tokens, top_k)
    assert fp8 == (w2_scale is not None) == (w13.dtype == FP8) == (w2.dtype == FP8)
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    up, down = config or (tiles(pairs, experts, two_inter, hidden, fp8),
                          tiles(pairs, experts, hidden, two_inter // 2, fp8))
    assert up.block_m == down.block_m, "both GEMMs read one sorted order"
    sorted_ids, expert_ids, _ = align(topk_ids, experts, first_expert, up.block_m)
    a, a_scale = per_token_quant(x) if fp8 else (x, None)
    gate_up = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(a, a_scale, w13, w13_scale, gate_up, sorted_ids, expert_ids, top_k, up)
    h = silu_and_mul(gate_up, quantize=fp8)
    a, a_scale = h if fp8 else (h, None)
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(a, a_scale, w2, w2_scale, y, sorted_ids, expert_ids, 1, down)
    moe_sum(y, topk_weights, topk_ids, first_expert, experts, out)
    return out


def moe_sum(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            first_expert: int, num_experts: int, out: torch.Tensor) -> None:
    """out [T, H] = the module docstring's step 5 from y [T*K, H], the slots' down outputs
    (the rows of slots outside the local range are never read)."""
    tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    assert y.is_contiguous() and y.shape == (tokens * top_k, hidden) and out.stride(-1) == 1
    block_h = min(SUM_BLOCK, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, block_h))](
        y, topk_ids, topk_weights, out, first_expert, num_experts, hidden, out.stride(0),
        TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_H=block_h,
        num_warps=4, **pdl_args(out.device))
