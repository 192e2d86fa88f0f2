"""The tensor-parallel group's all-reduce for decode-sized messages, one launch, no NCCL:
16-bit messages up to PUSH_MAX_BYTES are pushed into the peers' memory, the data its own
signal (kernels/peer_push_all_reduce.py); others are read from the peers' memory after a
barrier (kernels/peer_all_reduce.py).

A decode step of a TP model all-reduces after every row-parallel layer: 2 x layers messages
of batch x hidden values (a 70B model at batch 64: 160 messages of 1 MB a step). NCCL's
latency for such a message is several times the time NVLink needs to move it, so these go
through `PeerAllReduce`; larger ones (prefill) and groups whose GPUs cannot map each other's
memory keep NCCL (pd_cluster/distributed.py chooses, by size alone, so every rank chooses
alike).

Lifecycle: every rank builds one at the same point (a collective over the group's gloo
group: all or none of the ranks get one), calls it with the same sequence of shapes, and
closes it when the engine closes.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from pd_cluster import peer_memory

logger = logging.getLogger(__name__)

MAX_BYTES = 8 << 20         # a decode graph's largest message: 512 rows x 8192 x bf16
ONE_SHOT_MAX_BYTES = 256 << 10   # above this (and more than 2 ranks) two-shot reads less
PUSH_MAX_BYTES = 2 << 20    # a push slot: a 70B model's message at batch 128 (128 x 8192 x 2)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Polls of a peer's signal before a program gives up on it (a dead rank): seconds on a GPU.
MAX_SPINS = 1 << 24


def peers_reachable(device: torch.device, group: list[torch.device]) -> bool:
    """Whether this rank's GPU can map the memory of every other GPU of the group."""
    return all(torch.cuda.can_device_access_peer(device.index, d.index)
               for d in group if d != device)


class PeerUnavailable(RuntimeError):
    """Some rank could not share or map peer memory (every rank raises it alike)."""


class PeerAllReduce:
    def __init__(self, rank: int, world: int, device: torch.device, cpu_group: Any,
                 max_bytes: int = MAX_BYTES):
        from kernels import peer_all_reduce as k
        from kernels import peer_push_all_reduce as push

        self.rank, self.world, self.device, self.max_bytes = rank, world, device, max_bytes
        assert max_bytes % (k.BLOCK * 4) == 0, "every half must hold whole chunks"
        self._kernels, self._push = k, push
        data = 2 * max_bytes
        self.push_bytes = min(max_bytes, PUSH_MAX_BYTES)
        push_region = 2 * world * self.push_bytes
        self.memory = self._share(k.SIGNAL_BYTES + 2 * data + max_bytes + push_region, cpu_group)
        empty = torch.full((push_region // 2,), push.EMPTY_BITS, dtype=torch.int16)
        self.memory.write(k.SIGNAL_BYTES + 2 * data + max_bytes, empty.numpy().tobytes())
        # Every rank has mapped every region, and emptied its push slots, before any rank
        # signals or pushes into one.
        dist.barrier(group=cpu_group)
        bases = self._bases

        def table(offset: int) -> torch.Tensor:
            return torch.tensor([b + offset for b in bases], dtype=torch.int64, device=device)

        self.sig_ptrs = table(0)
        self.data_ptrs = table(k.SIGNAL_BYTES)
        self.red_ptrs = table(k.SIGNAL_BYTES + data)
        self.norm_ptrs = table(k.SIGNAL_BYTES + data + max_bytes)    # the fused kernel's
        self.push_ptrs = table(k.SIGNAL_BYTES + 2 * data + max_bytes)
        self.counters = torch.zeros(k.PROGRAMS, dtype=torch.int64, device=device)
        self.push_counters = torch.zeros(k.PROGRAMS, dtype=torch.int64, device=device)
        self.failed = torch.zeros(1, dtype=torch.int32, device=device)
        self.max_spins = MAX_SPINS

    def _share(self, nbytes: int, cpu_group: Any) -> peer_memory.PeerMemory:
        """Allocate this rank's region and map every other's; all ranks or none."""
        memory, problem = None, ""
        try:
            memory = peer_memory.allocate(nbytes, self.device)
        except (OSError, RuntimeError) as e:
            problem = f"rank {self.rank}: {e}"
        handles: list[Any] = [None] * self.world
        dist.all_gather_object(handles, memory.handle if memory else problem, group=cpu_group)
        problems = [h for h in handles if isinstance(h, str)]
        if not problems:
            try:
                self._bases = [memory.address if r == self.rank else memory.open(h)
                               for r, h in enumerate(handles)]
            except (OSError, RuntimeError) as e:
                problem = f"rank {self.rank}: {e}"
            votes: list[Any] = [None] * self.world
            dist.all_gather_object(votes, problem, group=cpu_group)
            problems = [v for v in votes if v]
        if problems:
            if memory is not None:
                memory.close()
            raise PeerUnavailable("; ".join(problems))
        return memory

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes through this all-reduce (a decision every rank makes alike)."""
        return (x.dtype in DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x <- the sum of every rank's x, in place."""
        if x.data_ptr() % 16:           # the kernels load 16 bytes at a time
            return x.copy_(self(x.clone()))
        if self._pushes(x):
            return self._push.push_all_reduce(
                x, x, self.push_bytes // 2, self.rank, self.world, self.push_ptrs,
                self.push_counters, self.failed, self.max_spins)
        two_shot = self.world > 2 and x.numel() * x.element_size() > ONE_SHOT_MAX_BYTES
        return self._kernels.peer_all_reduce(
            x, x, self.max_bytes // x.element_size(), self.rank, self.world, self.sig_ptrs,
            self.data_ptrs, self.red_ptrs, self.counters, self.failed, two_shot, self.max_spins)

    def _pushes(self, x: torch.Tensor) -> bool:
        """Whether x goes by push: 16 bits (-0.0 marks an empty slot) and a slot holds it."""
        return x.dtype in self._push.DTYPES and x.numel() * 2 <= self.push_bytes

    def fits_rows(self, x: torch.Tensor) -> bool:
        """Whether x [T, hidden] can take the fused all-reduce + residual + RMSNorm."""
        hidden = x.shape[-1]
        return self.fits(x) and x.dim() == 2 and (hidden & -hidden) * x.element_size() >= 16

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, quantize: bool):
        """(weight * rmsnorm(sum of every rank's x + residual), that sum + residual): the
        all-reduce of a row-parallel layer's output fused with the norm after it."""
        if x.data_ptr() % 16:
            x = x.clone()
        if self._pushes(x):
            return self._push.push_all_reduce_rms_norm(
                x, residual, weight, eps, quantize, self.push_bytes // 2, self.rank,
                self.world, self.push_ptrs, self.push_counters, self.failed, self.max_spins)
        return self._kernels.peer_all_reduce_rms_norm(
            x, residual, weight, eps, quantize, self.max_bytes // x.element_size(), self.rank,
            self.world, self.sig_ptrs, self.norm_ptrs, self.counters, self.failed,
            self.max_spins)

    def peer_lost(self) -> bool:
        """Whether a call gave up waiting for a peer (its output was garbage). Synchronizes."""
        return bool(self.failed.item())

    def close(self) -> None:
        self.memory.close()
