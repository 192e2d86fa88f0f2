"""The KV pool's same-node fast path: the pool's block memory is a shared-memory segment that
the engines on its node map into their own process, so moving a prompt's blocks between an
engine's KV cache and the pool is a copy in the engine's process (GPU: cudaMemcpy between
device memory and pinned host memory, ~50 GB/s on an H100 host) instead of UCX between GPU
memory and another process's host memory (0.4-0.9 GB/s measured by bench/host_path_probe.py,
at commit 2d4c556).

    pool    SharedSegment.create(layout)  a file in /dev/shm, unlinked at once: it lives as
                                         long as some process has it open or mapped, so a
                                         killed pool leaks nothing; engines open it through
                                         /proc/<pool pid>/fd/<fd> (same node, same user)
    engine  SharedSegment.attach(handle)  maps it (pinned for DMA where CUDA is), or None if
                                         it is not on our node or cannot be opened
            copy_blocks(src, dst, ...)    the blocks, one copy per run of consecutive blocks
                                         per layer and K/V, on a side stream, synchronized
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pd_cluster.kv_layout import KVLayout

log = logging.getLogger(__name__)
# False once a kernel copy failed in this process (a driver without the host mapping): DMA.
_kernel_copies = True


@dataclass(frozen=True, slots=True)
class SegmentHandle:
    """Where an engine on the pool's node finds its block memory."""

    node_id: str      # the Ray node of the pool
    path: str         # /proc/<pid>/fd/<fd> of the pool's open, unlinked segment
    layout: KVLayout


def _pin(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory for the GPU's DMA engines (a no-op without CUDA)."""
    if not torch.cuda.is_available():
        return False
    # Portable and mapped (1 | 2): every GPU may DMA it, and kernels address it directly
    # (kernels/kv_block_copy.py).
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 3)
    return int(err) == 0


def _map(path: str, layout: KVLayout) -> torch.Tensor:
    # As bytes, then viewed as the KV dtype: from_file need not know every dtype (FP8).
    flat = torch.from_file(path, shared=True, size=_nbytes(layout), dtype=torch.uint8)
    return flat.view(layout.torch_dtype).view(layout.shape)


def _nbytes(layout: KVLayout) -> int:
    return math.prod(layout.shape) * torch.empty((), dtype=layout.torch_dtype).element_size()


class SharedSegment:
    """A KV tensor of `layout` in shared memory (see the module docstring)."""

    def __init__(self, kv: torch.Tensor, handle: SegmentHandle, fd: int | None = None):
        self.kv, self.handle, self._fd = kv, handle, fd
        self.pinned = _pin(kv)

    @classmethod
    def create(cls, layout: KVLayout, node_id: str) -> SharedSegment:
        nbytes = _nbytes(layout)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="pd-kv-pool-", dir=shm)
        try:
            # Reserve the memory now: a segment larger than /dev/shm has room for fails here
            # (OSError) instead of killing us with SIGBUS at the first write past the room.
            os.posix_fallocate(fd, 0, nbytes)
            kv = _map(path, layout)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)   # the open fd (and the mapping) keep it
        return cls(kv, SegmentHandle(node_id, f"/proc/{os.getpid()}/fd/{fd}", layout), fd)

    @classmethod
    def attach(cls, handle: SegmentHandle, node_id: str) -> SharedSegment | None:
        """The pool's segment mapped here, or None when it is on another node or cannot be
        opened (another user, a separate /proc): the caller uses the transport then."""
        if handle.node_id != node_id:
            return None
        try:
            return cls(_map(handle.path, handle.layout), handle)
        except (OSError, RuntimeError):
            return None

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.kv.data_ptr())
            self.pinned = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both block lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int],
                dst_ids: Sequence[int], host_mapped: bool = False) -> None:
    """dst's blocks dst_ids[i] = src's blocks src_ids[i], every layer's K and V; returns once
    they are there. Both are [layers, 2, blocks, ...]; one is on the GPU or both on the CPU.
    `host_mapped`: the host one is registered with CUDA (SharedSegment.pinned), so one kernel
    on the GPU moves every block (kernels/kv_block_copy.py); else each copy is one
    contiguous run of one layer's K or V, a single DMA on a GPU."""
    global _kernel_copies
    if not src_ids:
        return
    s2, d2 = src.flatten(0, 1), dst.flatten(0, 1)
    gpu = src.device if src.device.type == "cuda" else dst.device
    stream = torch.cuda.Stream(gpu) if gpu.type == "cuda" else None
    if stream is None:
        _copy_runs(s2, d2, block_runs(src_ids, dst_ids), non_blocking=False)
        return
    stream.wait_stream(torch.cuda.current_stream(gpu))
    with torch.cuda.stream(stream):
        if host_mapped and _kernel_copies:
            try:
                from kernels.kv_block_copy import copy_blocks as copy_by_kernel
                copy_by_kernel(src, dst, src_ids, dst_ids)
                stream.synchronize()
                return
            except Exception as e:  # noqa: BLE001 - the DMA copies below still work
                _kernel_copies = False
                log.warning("KV block copies by kernel failed (%r); copying by DMA", e)
        _copy_runs(s2, d2, block_runs(src_ids, dst_ids), non_blocking=True)
    stream.synchronize()


def _copy_runs(s2: torch.Tensor, d2: torch.Tensor, runs: list[tuple[int, int, int]],
               non_blocking: bool) -> None:
    for i in range(s2.shape[0]):
        src_i, dst_i = s2[i], d2[i]
        for s, d, n in runs:
            dst_i[d:d + n].copy_(src_i[s:s + n], non_blocking=non_blocking)
