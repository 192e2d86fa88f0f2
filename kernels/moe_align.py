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
forty small launches, whatever T; the reference. `moe_align_one_program`: one Triton program
(after a fill), for the pairs of a decode batch (up to ONE_PROGRAM_MAX_PAIRS), where those
launches cost far more than the work: at 48 layers a step, forty graph nodes of a few
microseconds each add up to milliseconds of a step of about 15. It walks the pairs CHUNK at a time against all
experts at once ([E, CHUNK] one-hot tiles): counts per expert, then each pair's row (its
expert's run start, plus the pairs of that expert before it), then each block's expert.
`align` picks between them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs (T * K) up to which `align` takes the one-program kernel: decode batches up to 128 at
# top-8. Its loops walk the pairs one chunk after another, a few microseconds each, so past
# some size the torch ops' parallel sort wins: where is unmeasured (bench/moe_bench.py times
# both, `align_us`).
ONE_PROGRAM_MAX_PAIRS = 1024
TILE = 8192             # elements of the kernel's [E, CHUNK] tiles


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
def _align_kernel(TopkIds, SortedIds, ExpertIds, NumPadded, pairs, first_expert, num_experts,
                  num_blocks, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr,
                  CHUNK: tl.constexpr):
    """The module docstring's outputs, one program; SortedIds already holds the sentinel."""
    experts = tl.arange(0, E_POW2)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for p0 in range(0, pairs, CHUNK):
        hit = _one_hot(TopkIds, p0 + offs, pairs, first_expert, num_experts, experts)
        counts += tl.sum(hit, axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(NumPadded, tl.sum(padded, axis=0))
    # Each pair's row: its expert's next free row. A pair's expert is the one hot row of its
    # column, so sums over experts pick that expert's values.
    free = ends - padded
    for p0 in range(0, pairs, CHUNK):
        hit = _one_hot(TopkIds, p0 + offs, pairs, first_expert, num_experts, experts)
        earlier = tl.cumsum(hit, axis=1) - hit      # the expert's pairs before, in this chunk
        row = tl.sum(hit * (free[:, None] + earlier), axis=0)
        tl.store(SortedIds + row, p0 + offs, mask=tl.sum(hit, axis=0) > 0)
        free += tl.sum(hit, axis=1)
    # Each block's expert: how many experts' runs end at or before its first row (torch's
    # searchsorted(ends, start, right=True)); -1 past the last run.
    real = experts < num_experts
    for b0 in range(0, num_blocks, CHUNK):
        block = b0 + offs
        before = (ends[:, None] <= block[None, :] * BLOCK_M) & real[:, None]
        expert = tl.sum(before.to(tl.int32), axis=0)
        tl.store(ExpertIds + block, tl.where(expert < num_experts, expert, -1),
                 mask=block < num_blocks)


@triton.jit
def _one_hot(TopkIds, pair, pairs, first_expert, num_experts, experts):
    """[E_POW2, CHUNK] int32: 1 where column `pair`'s local expert is the row's; a column
    past the pairs, or of an expert outside the local range, all 0."""
    ids = tl.load(TopkIds + pair, mask=pair < pairs, other=-1)
    local = (ids - first_expert).to(tl.int32)
    keep = (pair < pairs) & (local >= 0) & (local < num_experts)
    return ((local[None, :] == experts[:, None]) & keep[None, :]).to(tl.int32)


def moe_align_one_program(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align`'s outputs by one Triton program (module docstring), topk_ids contiguous."""
    assert topk_ids.is_contiguous()
    pairs, experts = topk_ids.numel(), num_local_experts
    size = padded_size(pairs, experts, block_m)
    sorted_ids = torch.full((size,), pairs, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=topk_ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    e_pow2 = triton.next_power_of_2(experts)
    chunk = max(16, min(1024, TILE // e_pow2))
    _align_kernel[(1,)](topk_ids, sorted_ids, expert_ids, num_padded, pairs, first_expert,
                        experts, size // block_m, BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk,
                        num_warps=8)
    return sorted_ids, expert_ids, num_padded


def align(topk_ids: torch.Tensor, num_local_experts: int, first_expert: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align`'s outputs, by one program up to ONE_PROGRAM_MAX_PAIRS pairs, else by torch
    ops (module docstring). For Triton's tensors: CUDA, or any under its interpreter."""
    if topk_ids.numel() <= ONE_PROGRAM_MAX_PAIRS:
        return moe_align_one_program(topk_ids.contiguous(), num_local_experts, first_expert,
                                     block_m)
    return moe_align(topk_ids, num_local_experts, first_expert, block_m)
