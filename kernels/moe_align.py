"""The (token, slot) pairs of a MoE layer grouped by local expert, in tiles of block_m rows:
the row order of kernels/fused_moe_triton.py's grouped GEMM.

    topk_ids         [T, K]      global expert ids (int32 or int64); pair p = t * K + k
    sorted_ids       [size]      int32: the pairs of local expert 0, then of expert 1, ...,
                                 each expert's run padded to a multiple of block_m with the
                                 sentinel T * K; within a run, pairs in ascending order
    expert_ids       [size // block_m]  int32: the local expert of each block of block_m
                                 rows, -1 for the blocks past the last expert's run
    num_padded       [1]         int32: the rows the experts' runs take (a multiple of
                                 block_m); the blocks from there on are all -1

Local expert e is global expert first_expert + e, for e < E (num_local_experts); a pair
whose expert lies outside that range is dropped (it contributes nothing on this rank).

No host sync: no .item() or .tolist(), and every shape depends on T, K, E and block_m alone,
so a CUDA graph can capture it. `size` is the worst case: the runs take at most
T*K + n * (block_m - 1) rows, n = min(E, T*K) being the most experts that can be chosen.

Two ways, one result. `moe_align`: torch ops (a stable sort, a scatter and a search), some
forty small launches, whatever T; the reference. `moe_align_one_launch`: one Triton launch
of a program per local expert, for the pairs of a decode batch (up to ONE_LAUNCH_MAX_PAIRS),
where those launches cost far more than the work: at 48 layers a step, forty graph nodes of
a few microseconds each add up to milliseconds of a step of about 15. Each program counts
every expert's pairs (a histogram of the ids, CHUNK pairs at a time), which places its run,
then writes its own pairs there in order (a cumulative sum of its hits), the sentinel in its
run's padding and its blocks' expert id. (A single program that ranked all experts' pairs
at once, [E, CHUNK] one-hot tiles and their cumulative sums, took 13 us at 384 pairs and
24 us at 768 on an H200: half a millisecond of DeepSeek-V2-Lite's batch-128 step.) `align`
picks between them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs (T * K) up to which `align` takes the one-launch kernel: decode batches up to 128 at
# top-8. Its loops walk the pairs one chunk after another, a few microseconds each, so past
# some size the torch ops' parallel sort wins: where is unmeasured (bench/moe_bench.py times
# both, `align_us`).
ONE_LAUNCH_MAX_PAIRS = 1024
CHUNK = 256             # pairs a program takes at a time


def padded_size(pairs: int, num_local_experts: int, block_m: int) -> int:
    """`size`, the rows sorted_ids holds for `pairs` (T * K) pairs (module docstring): the
    largest multiple of block_m within the worst case, since every run is such a multiple."""
    worst = pairs + min(num_local_experts, pairs) * (block_m - 1)
    return worst // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_padded) for topk_ids [T, K] (module docstring)."""
    pairs, experts = topk_ids.numel(), num_local_experts
    device = topk_ids.device
    size = padded_size(pairs, experts, block_m)
    local = topk_ids.reshape(-1).long() - first_expert
    # Pairs outside the local range go to bin `experts`, past the last expert, and are dropped.
    expert = torch.where((local >= 0) & (local < experts), local, experts)
    counts = torch.zeros(experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[experts:].fill_(0)        # fill_, not a copy from the host: CUDA graphs capture it
    ends = padded.cumsum(0)
    # Stable: within an expert's run the pairs keep ascending order (bin `experts` sorts last).
    sorted_expert, order = torch.sort(expert, stable=True)
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[sorted_expert]
    # A dropped pair's row is `size`, one past the end, cut off below.
    row = torch.where(sorted_expert < experts, (ends - padded)[sorted_expert] + rank, size)
    sorted_ids = torch.full((size + 1,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, row, order.int())
    # The expert whose run holds a block's first row; none (-1) past the last run.
    block_starts = torch.arange(0, size, block_m, device=device)
    expert_ids = torch.searchsorted(ends[:experts], block_starts, right=True)
    expert_ids = torch.where(expert_ids < experts, expert_ids, -1).int()
    return sorted_ids[:size], expert_ids, ends[experts:].int()


@triton.jit
def _local_expert(TopkIds, pair, pairs, first_expert, num_experts, BINS: tl.constexpr):
    """[CHUNK] int32: each pair's local expert; BINS - 1 (past every real expert) for a pair
    past `pairs` or of an expert outside the local range."""
    ids = tl.load(TopkIds + pair, mask=pair < pairs, other=-1)
    local = (ids - first_expert).to(tl.int32)
    keep = (pair < pairs) & (local >= 0) & (local < num_experts)
    return tl.where(keep, local, BINS - 1)


@triton.jit
def _align_kernel(TopkIds, SortedIds, ExpertIds, NumPadded, pairs, first_expert, num_experts,
                  num_blocks, size, BLOCK_M: tl.constexpr, BINS: tl.constexpr,
                  CHUNK: tl.constexpr):
    """Program e: local expert e's run of SortedIds (its pairs, then the sentinel) and its
    blocks' ExpertIds; program 0 also the rows and blocks past the last run, and NumPadded.
    Every program counts all experts itself (a histogram of the pairs, cheap at decode
    sizes), so no program waits on another."""
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for p0 in range(0, pairs, CHUNK):
        counts += tl.histogram(_local_expert(TopkIds, p0 + offs, pairs, first_expert,
                                             num_experts, BINS), BINS)
    padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(bins < e, padded, 0), axis=0)
    filled = start + tl.sum(tl.where(bins == e, counts, 0), axis=0)
    end = start + tl.sum(tl.where(bins == e, padded, 0), axis=0)
    row = start
    for p0 in range(0, pairs, CHUNK):      # its pairs, in ascending order
        hit = (_local_expert(TopkIds, p0 + offs, pairs, first_expert, num_experts,
                             BINS) == e).to(tl.int32)
        tl.store(SortedIds + row + tl.cumsum(hit, axis=0) - hit, p0 + offs, mask=hit > 0)
        row += tl.sum(hit, axis=0)
    _fill(SortedIds, filled, end, pairs, CHUNK)
    _fill(ExpertIds, start // BLOCK_M, end // BLOCK_M, e, CHUNK)
    if e == 0:
        total = tl.sum(padded, axis=0)
        tl.store(NumPadded, total)
        _fill(SortedIds, total, size, pairs, CHUNK)
        _fill(ExpertIds, total // BLOCK_M, num_blocks, -1, CHUNK)


@triton.jit
def _fill(Out, start, end, value, CHUNK: tl.constexpr):
    """Out[start:end] = value."""
    for i0 in range(start, end, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        tl.store(Out + i, tl.full([CHUNK], value, tl.int32), mask=i < end)


def moe_align_one_launch(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align`'s outputs by one launch (module docstring), topk_ids contiguous."""
    assert topk_ids.is_contiguous()
    pairs, experts = topk_ids.numel(), num_local_experts
    size = padded_size(pairs, experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=topk_ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(experts,)](topk_ids, sorted_ids, expert_ids, num_padded, pairs,
                              first_expert, experts, size // block_m, size, BLOCK_M=block_m,
                              BINS=triton.next_power_of_2(experts + 1), CHUNK=CHUNK,
                              num_warps=4)
    return sorted_ids, expert_ids, num_padded


def align(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align`'s outputs, by one launch up to ONE_LAUNCH_MAX_PAIRS pairs, else by torch
    ops (module docstring). For Triton's tensors: CUDA, or any under its interpreter."""
    if topk_ids.numel() <= ONE_LAUNCH_MAX_PAIRS:
        return moe_align_one_launch(topk_ids.contiguous(), num_local_experts, first_expert,
                                     block_m)
    return moe_align(topk_ids, num_local_experts, first_expert, block_m)
