"""All-reduce over peer-mapped buffers, one-shot and two-shot: decode-sized messages without
NCCL's latency (the idea of vLLM's and SGLang's custom all-reduce, written in Triton).

Each rank of a group owns one buffer, and every rank can address every rank's buffer (CUDA
IPC over NVLink on GPUs; shared memory on a CPU under the interpreter). The caller passes, per
region, a table of the ranks' addresses as mapped in its own process:

    sig_ptrs   int64 [WORLD]  signals  int64 [PROGRAMS, WORLD]: slot [p, s] is the last epoch
                                       rank s's program p announced to this rank (starts at 0)
    data_ptrs  int64 [WORLD]  data     2 halves of `half_elems` elements: copied-in inputs
    red_ptrs   int64 [WORLD]  reduced  `half_elems` elements: a rank's reduced chunks (two-shot)

Shapes: x [n] and out [n] (flattened; bf16, fp16 or fp32; n <= half_elems), the same n on
every rank. out = the sum over ranks of x, added in fp32 in rank order, so every rank gets
the same bits. Reference: `all_reduce_ref`.

Programs: PROGRAMS of them at most, and program p always owns the chunks c with
c % PROGRAMS == p, whatever n is. So two calls' programs touch the same bytes only if they are
the same program, and a program need only synchronise with the same program on the other
ranks: it writes its epoch into slot [p, me] of every peer's signals (release, after its
stores) and waits until its own slots [p, s] reach that epoch (acquire). Epochs are counted
on the device (`counters` int64 [PROGRAMS], this rank's, advanced by the kernel), so a CUDA
graph replays the right ones.

    one-shot (1 barrier):  x -> data[e % 2]; barrier; out = sum of every rank's data[e % 2]
        (the parity makes one barrier enough: a rank that runs ahead into the next call
        writes the other half while a peer may still be reading this one)
    two-shot (2 barriers): x -> data[e % 2]; barrier; the chunks this rank owns are summed
        into its `reduced` and out; barrier; the other chunks are copied from their owner's
        `reduced`. Each rank reads 2 (W - 1) / W of the message instead of W - 1 messages.

Fused with the residual add and RMSNorm that follow a row-parallel layer (`peer_all_reduce_
rms_norm`, one-shot, a region `norm_ptrs` of its own): rows of x [T, hidden] instead of flat
chunks, program p owning the rows r with r % PROGRAMS == p, and after the sum the row is
added to the residual and normalised exactly as kernels/rmsnorm.py does (its FP8 quant too).

A peer that never arrives (its process died) does not hang the GPU: a program gives up after
`max_spins` polls and sets failed[0] = 1; that output is garbage and the caller must fail.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8
from kernels.rmsnorm import store_normalized_row

PROGRAMS = 64       # chunk owners; at most this many programs run, all resident at once
BLOCK = 4096        # elements a program moves per chunk (8 KB of bf16)
SIGNAL_BYTES = PROGRAMS * 8 * 8     # signals for up to 8 ranks


def all_reduce_ref(xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the ranks' inputs, added in fp32 in rank order."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


@triton.jit
def _ptr(table, rank, ELEM: tl.constexpr):
    return tl.load(table + rank).to(tl.pointer_type(ELEM))


@triton.jit
def _region(table, rank, X):
    """Rank `rank`'s region as X plus an element offset, not as an address cast from an
    integer: Triton knows X's alignment (16 bytes, `fits` checks it) but not a cast
    address's, and vectorizes only loads and stores it knows to be aligned."""
    ELEM_BYTES: tl.constexpr = X.dtype.element_ty.primitive_bitwidth // 8
    delta = (tl.load(table + rank) - X.to(tl.int64)) // ELEM_BYTES
    return X + tl.multiple_of(delta, 16 // ELEM_BYTES)


@triton.jit
def _barrier(sig_ptrs, rank, p, epoch, max_spins, failed, WORLD: tl.constexpr):
    tl.debug_barrier()      # every thread's stores of this program come before the signal
    for s in tl.static_range(WORLD):
        if s != rank:
            peer = _ptr(sig_ptrs, s, tl.int64)
            tl.atomic_xchg(peer + p * WORLD + rank, epoch, sem="release", scope="sys")
    mine = _ptr(sig_ptrs, rank, tl.int64)
    for s in tl.static_range(WORLD):
        if s != rank:
            seen = tl.atomic_add(mine + p * WORLD + s, 0, sem="acquire", scope="sys")
            spins = 0
            while (seen < epoch) & (spins < max_spins):
                seen = tl.atomic_add(mine + p * WORLD + s, 0, sem="acquire", scope="sys")
                spins += 1
            if seen < epoch:
                tl.store(failed, 1)
    tl.debug_barrier()      # no thread reads a peer's data before the signals are in


@triton.jit
def _copy_in(X, data_ptrs, rank, half, p, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    dst = _region(data_ptrs, rank, X)
    for c in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        idx = c * BLOCK + offs
        m = idx < n
        tl.store(dst + _in_half(half, c * BLOCK, BLOCK) + offs, tl.load(X + idx, mask=m), mask=m)


@triton.jit
def _in_half(half, start, ALIGN: tl.constexpr):
    # An element `start` of a half, a multiple of ALIGN, which the vectorizer must be told.
    return tl.multiple_of(half + start, ALIGN)


@triton.jit
def _sum_chunk(X, data_ptrs, half, c, m, BLOCK: tl.constexpr, WORLD: tl.constexpr):
    offs = _in_half(half, c * BLOCK, BLOCK) + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(WORLD):
        src = _region(data_ptrs, s, X)
        acc += tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc.to(X.dtype.element_ty)


@triton.jit
def _arrive(X, n, half_elems, sig_ptrs, data_ptrs, counters, failed, rank, max_spins, p,
            WORLD: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    """Program p's call begins: its epoch and data half, x copied in, the first barrier."""
    epoch = tl.load(counters + p) + 1
    half = (epoch % 2) * half_elems
    _copy_in(X, data_ptrs, rank, half, p, n, BLOCK, PROGRAMS)
    _barrier(sig_ptrs, rank, p, epoch, max_spins, failed, WORLD)
    return epoch, half


@triton.jit
def _one_shot_kernel(X, Out, n, half_elems, sig_ptrs, data_ptrs, counters, failed, rank,
                     max_spins, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     PROGRAMS: tl.constexpr):
    p = tl.program_id(0)
    epoch, half = _arrive(X, n, half_elems, sig_ptrs, data_ptrs, counters, failed, rank,
                          max_spins, p, WORLD, BLOCK, PROGRAMS)
    offs = tl.arange(0, BLOCK)
    for c in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        idx = c * BLOCK + offs
        m = idx < n
        tl.store(Out + idx, _sum_chunk(X, data_ptrs, half, c, m, BLOCK, WORLD), mask=m)
    tl.store(counters + p, epoch)


@triton.jit
def _two_shot_kernel(X, Out, n, half_elems, sig_ptrs, data_ptrs, red_ptrs, counters, failed,
                     rank, max_spins, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     PROGRAMS: tl.constexpr):
    p = tl.program_id(0)
    epoch, half = _arrive(X, n, half_elems, sig_ptrs, data_ptrs, counters, failed, rank,
                          max_spins, p, WORLD, BLOCK, PROGRAMS)
    offs = tl.arange(0, BLOCK)
    # A program's successive chunks go to successive owners, so every program has work.
    for c in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        if (c // PROGRAMS) % WORLD == rank:
            idx = c * BLOCK + offs
            m = idx < n
            total = _sum_chunk(X, data_ptrs, half, c, m, BLOCK, WORLD)
            tl.store(_region(red_ptrs, rank, X) + idx, total, mask=m)
            tl.store(Out + idx, total, mask=m)
    _barrier(sig_ptrs, rank, p, epoch + 1, max_spins, failed, WORLD)
    for c in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        owner = (c // PROGRAMS) % WORLD
        if owner != rank:
            idx = c * BLOCK + offs
            m = idx < n
            src = _region(red_ptrs, owner, X)
            tl.store(Out + idx, tl.load(src + idx, mask=m, cache_modifier=".cg"), mask=m)
    tl.store(counters + p, epoch + 1)


@triton.jit
def _one_shot_rms_norm_kernel(X, Residual, ResidualOut, Weight, Out, Scale, eps, rows,
                              half_elems, sig_ptrs, norm_ptrs, counters, failed, rank,
                              max_spins, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                              ALIGN: tl.constexpr, WORLD: tl.constexpr,
                              PROGRAMS: tl.constexpr, QUANT: tl.constexpr):
    p = tl.program_id(0)
    epoch = tl.load(counters + p) + 1
    half = (epoch % 2) * half_elems
    offs = tl.arange(0, BLOCK)
    m = offs < HIDDEN
    mine = _region(norm_ptrs, rank, X)
    for r in range(p, rows, PROGRAMS):
        at = _in_half(half, r * HIDDEN, ALIGN) + offs
        tl.store(mine + at, tl.load(X + r * HIDDEN + offs, mask=m), mask=m)
    _barrier(sig_ptrs, rank, p, epoch, max_spins, failed, WORLD)
    for r in range(p, rows, PROGRAMS):
        at = _in_half(half, r * HIDDEN, ALIGN) + offs
        acc = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(WORLD):
            src = _region(norm_ptrs, s, X)
            acc += tl.load(src + at, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        total = acc.to(X.dtype.element_ty)              # what the all-reduce alone returns
        res = tl.load(Residual + r * HIDDEN + offs, mask=m, other=0.0)
        x = (total.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + r * HIDDEN + offs, x, mask=m)
        store_normalized_row(x, Weight, Out + r * HIDDEN, Scale + r, offs, m, eps, HIDDEN, QUANT)
    tl.store(counters + p, epoch)


def peer_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float, quantize: bool, half_elems: int, rank: int,
                             world: int, sig_ptrs: torch.Tensor, norm_ptrs: torch.Tensor,
                             counters: torch.Tensor, failed: torch.Tensor,
                             max_spins: int = 1 << 24):
    """x [T, hidden] (this rank's partial sums), residual [T, hidden] -> (out, residual_out):
    residual_out = sum over ranks of x + residual, out = weight * rmsnorm(residual_out), as
    kernels/rmsnorm.py `fused_add_rms_norm` gives them ((xq, scale) with `quantize`)."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and x.numel() <= half_elems
    out = torch.empty(x.shape, dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quantize else None
    residual_out = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _one_shot_rms_norm_kernel[(min(PROGRAMS, rows),)](
        x, residual, residual_out, weight, out, weight if scale is None else scale, eps, rows,
        half_elems, sig_ptrs, norm_ptrs, counters, failed, rank, max_spins, HIDDEN=hidden,
        BLOCK=block, ALIGN=hidden & -hidden, WORLD=world, PROGRAMS=PROGRAMS, QUANT=quantize,
        num_warps=min(max(block // 256, 4), 16))
    return (out if scale is None else (out, scale)), residual_out


def add_rms_norm_ref(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-reduce, then the residual add and RMSNorm of kernels/rmsnorm.py, in torch."""
    x = (all_reduce_ref(xs).float() + residual.float()).to(residual.dtype)
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype), x


def peer_all_reduce(x: torch.Tensor, out: torch.Tensor, half_elems: int, rank: int,
                    world: int, sig_ptrs: torch.Tensor, data_ptrs: torch.Tensor,
                    red_ptrs: torch.Tensor, counters: torch.Tensor, failed: torch.Tensor,
                    two_shot: bool, max_spins: int = 1 << 24) -> torch.Tensor:
    """out <- the sum over the ranks of x (see the module docstring for the buffers)."""
    n = x.numel()
    assert x.is_contiguous() and out.is_contiguous() and n <= half_elems
    grid = (min(PROGRAMS, triton.cdiv(n, BLOCK)),)
    common = dict(WORLD=world, BLOCK=BLOCK, PROGRAMS=PROGRAMS, num_warps=8)
    if two_shot:
        _two_shot_kernel[grid](x, out, n, half_elems, sig_ptrs, data_ptrs, red_ptrs, counters,
                               failed, rank, max_spins, **common)
    else:
        _one_shot_kernel[grid](x, out, n, half_elems, sig_ptrs, data_ptrs, counters, failed,
                               rank, max_spins, **common)
    return out
