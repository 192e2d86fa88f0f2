"""All-reduce by pushing: each rank stores its input straight into every peer's memory, and
the data is its own signal (the Lamport-style one-shot of TensorRT-LLM's all-reduce), for
16-bit messages of a decode step.

kernels/peer_all_reduce.py's one-shot pays a barrier (a signal out, a signal back) and then
reads the peers' data over NVLink: two round trips. Here a rank's stores to its peers are
posted writes and a rank only ever polls its own memory, so a call costs about one one-way
trip. The price: a slot must read "empty" before the data lands, so -0.0 (bits 0x8000 in bf16
and fp16) is reserved as the empty mark; inputs send -0.0 as +0.0, which changes no sum
(sums start from +0.0).

Each rank owns a region of 16-bit elements, empty everywhere at start (`EMPTY_BITS`):

    push  [2 parities][WORLD senders][slot_elems]   slot [q][s]: what rank s pushed to this
                                                    rank in a call of parity q

and the caller passes `push_ptrs` int64 [WORLD], the ranks' regions as mapped in its own
process. Program p owns chunks c with c % PROGRAMS == p (rows r % PROGRAMS == p for the fused
norm). A program pushes its chunks to every peer, then for each peer polls its own slot until
no element of the chunk is empty, sums the ranks in rank order (fp32, so every rank gets the
same bits), and empties the slot again.

A call's parity is its count of push calls, kept on the device (`counters` int64 [PROGRAMS],
this rank's; CUDA graphs replay it): every program of every push call runs, work or none, and
advances its own copy, so all programs agree on it. (The two kernels split the slots
differently, chunks against rows, so one address belongs to different programs from call to
call; a parity of the call, not of the program, keeps the argument below true.)

Why emptying right after reading is safe: a peer writes parity q again only in its push call
two calls later; it gets there only after finishing the call between, which needed this
rank's data of that call, which this rank pushed in a later launch, after this one finished.

Shapes: x [n] (or [T, hidden] for `push_all_reduce_rms_norm`), bf16 or fp16, n <= slot_elems,
the same on every rank. References: kernels/peer_all_reduce.py `all_reduce_ref` and
`add_rms_norm_ref`. Both kernels take part in programmatic dependent launch (kernels/pdl.py),
as the RMSNorm they replace does. A peer that never pushes makes a program give up after
`max_spins` polls and set failed[0] = 1 (the output is garbage; the caller must fail).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8
from kernels.pdl import pdl_args, wait_for_inputs
from kernels.peer_all_reduce import BLOCK, PROGRAMS, _in_half, _region
from kernels.rmsnorm import store_normalized_row

EMPTY_BITS = -32768         # 0x8000 as int16: -0.0 in bf16 and fp16
_EMPTY = tl.constexpr(EMPTY_BITS)
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _sendable(x):
    """x with -0.0 sent as +0.0 (-0.0 marks an empty slot)."""
    bits = x.to(tl.int16, bitcast=True)
    return tl.where(bits == _EMPTY, 0, bits).to(x.dtype, bitcast=True)


@triton.jit
def _slot(push_ptrs, owner, sender, parity, slot_elems, X, WORLD: tl.constexpr):
    """Slot [parity][sender] of rank `owner`'s region, typed like X."""
    start = tl.multiple_of((parity * WORLD + sender) * slot_elems, 16)
    return _region(push_ptrs, owner, X) + start


@triton.jit
def _take(slot, offs, m, max_spins, failed):
    """Wait until the peer's data fills slot[offs] (m: the live lanes); return it and leave
    the slot empty."""
    v = tl.load(slot + offs, mask=m, other=0.0, volatile=True)
    waiting = tl.sum(((v.to(tl.int16, bitcast=True) == _EMPTY) & m).to(tl.int32), axis=0)
    spins = 0
    while (waiting > 0) & (spins < max_spins):
        v = tl.load(slot + offs, mask=m, other=0.0, volatile=True)
        waiting = tl.sum(((v.to(tl.int16, bitcast=True) == _EMPTY) & m).to(tl.int32),
                         axis=0)
        spins += 1
    if waiting > 0:
        tl.store(failed, 1)
    empty = tl.full(offs.shape, _EMPTY, tl.int16).to(v.dtype, bitcast=True)
    tl.store(slot + offs, empty, mask=m)
    return v


@triton.jit
def _gather_sum(x, push_ptrs, rank, parity, slot_elems, X, offs, m, max_spins, failed,
                WORLD: tl.constexpr):
    """The sum over ranks in rank order (this rank's own x in its place), fp32."""
    acc = tl.zeros(offs.shape, tl.float32)
    for s in tl.static_range(WORLD):
        if s == rank:
            acc += x.to(tl.float32)
        else:
            slot = _slot(push_ptrs, rank, s, parity, slot_elems, X, WORLD)
            acc += _take(slot, offs, m, max_spins, failed).to(tl.float32)
    return acc


@triton.jit
def _push(x, push_ptrs, rank, parity, slot_elems, X, offs, m, WORLD: tl.constexpr):
    for s in tl.static_range(WORLD):
        if s != rank:
            tl.store(_slot(push_ptrs, s, rank, parity, slot_elems, X, WORLD) + offs, x, mask=m)


@triton.jit
def _begin(counters, PDL: tl.constexpr):
    """A push call's start: its inputs ready (PDL), this program, its count of push calls
    with this one, and that count's parity."""
    wait_for_inputs(PDL)
    p = tl.program_id(0)
    epoch = tl.load(counters + p) + 1
    return p, epoch, epoch % 2


@triton.jit
def _push_kernel(X, Out, n, slot_elems, push_ptrs, counters, failed, rank, max_spins,
                 WORLD: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                 PDL: tl.constexpr):
    p, epoch, parity = _begin(counters, PDL)
    for c in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        offs = _in_half(0, c * BLOCK, BLOCK) + tl.arange(0, BLOCK)
        m = offs < n
        x = _sendable(tl.load(X + offs, mask=m, other=0.0))
        _push(x, push_ptrs, rank, parity, slot_elems, X, offs, m, WORLD)
    for c in range(p, tl.cdiv(n, BLOCK), PROGRAMS):
        offs = _in_half(0, c * BLOCK, BLOCK) + tl.arange(0, BLOCK)
        m = offs < n
        x = _sendable(tl.load(X + offs, mask=m, other=0.0))
        total = _gather_sum(x, push_ptrs, rank, parity, slot_elems, X, offs, m, max_spins,
                            failed, WORLD)
        tl.store(Out + offs, total.to(X.dtype.element_ty), mask=m)
    tl.store(counters + p, epoch)


@triton.jit
def _push_rms_norm_kernel(X, Residual, ResidualOut, Weight, Out, Scale, eps, rows,
                          slot_elems, push_ptrs, counters, failed, rank, max_spins,
                          HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                          WORLD: tl.constexpr, PROGRAMS: tl.constexpr, QUANT: tl.constexpr,
                          PDL: tl.constexpr):
    p, epoch, parity = _begin(counters, PDL)
    cols = tl.arange(0, BLOCK)
    m = cols < HIDDEN
    for r in range(p, rows, PROGRAMS):
        offs = _in_half(0, r * HIDDEN, ALIGN) + cols
        x = _sendable(tl.load(X + offs, mask=m, other=0.0))
        _push(x, push_ptrs, rank, parity, slot_elems, X, offs, m, WORLD)
    for r in range(p, rows, PROGRAMS):
        offs = _in_half(0, r * HIDDEN, ALIGN) + cols
        x = _sendable(tl.load(X + offs, mask=m, other=0.0))
        total = _gather_sum(x, push_ptrs, rank, parity, slot_elems, X, offs, m, max_spins,
                            failed, WORLD).to(X.dtype.element_ty)
        res = tl.load(Residual + offs, mask=m, other=0.0)
        h = (total.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResidualOut + offs, h, mask=m)
        store_normalized_row(h, Weight, Out + r * HIDDEN, Scale + r, cols, m, eps, HIDDEN,
                             QUANT)
    tl.store(counters + p, epoch)


def push_all_reduce(x: torch.Tensor, out: torch.Tensor, slot_elems: int, rank: int,
                    world: int, push_ptrs: torch.Tensor, counters: torch.Tensor,
                    failed: torch.Tensor, max_spins: int = 1 << 24) -> torch.Tensor:
    """out <- the sum over the ranks of x (x may be out)."""
    n = x.numel()
    assert x.dtype in DTYPES and x.is_contiguous() and out.is_contiguous() and n <= slot_elems
    _push_kernel[(PROGRAMS,)](
        x, out, n, slot_elems, push_ptrs, counters, failed, rank, max_spins, WORLD=world,
        BLOCK=BLOCK, PROGRAMS=PROGRAMS, num_warps=8, **pdl_args(x.device))
    return out


def push_all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float, quantize: bool, slot_elems: int, rank: int,
                             world: int, push_ptrs: torch.Tensor, counters: torch.Tensor,
                             failed: torch.Tensor, max_spins: int = 1 << 24):
    """x [T, hidden] (this rank's partial sums), residual [T, hidden] -> (out, residual_out):
    residual_out = sum over ranks of x + residual, out = weight * rmsnorm(residual_out), as
    kernels/rmsnorm.py `fused_add_rms_norm` gives them ((xq, scale) with `quantize`)."""
    rows, hidden = x.shape
    assert x.dtype in DTYPES and x.is_contiguous() and residual.is_contiguous()
    assert x.numel() <= slot_elems
    out = torch.empty(x.shape, dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quantize else None
    residual_out = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _push_rms_norm_kernel[(PROGRAMS,)](
        x, residual, residual_out, weight, out, weight if scale is None else scale, eps, rows,
        slot_elems, push_ptrs, counters, failed, rank, max_spins, HIDDEN=hidden, BLOCK=block,
        ALIGN=hidden & -hidden, WORLD=world, PROGRAMS=PROGRAMS, QUANT=quantize,
        num_warps=min(max(block // 256, 4), 16), **pdl_args(x.device))
    return (out if scale is None else (out, scale)), residual_out
