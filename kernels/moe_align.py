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
Torch ops (a stable sort, a scatter and a search, a dozen small launches): the work is tiny.
"""
from __future__ import annotations

import torch


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
    padded[experts] = 0
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
