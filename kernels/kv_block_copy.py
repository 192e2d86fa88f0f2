"""KV blocks between a GPU's KV cache and pinned host memory in one launch: the GPU reads (or
writes) the host memory itself, through unified virtual addressing, instead of one DMA copy
per block, layer and K/V (issue 47: the KV tiers' loads and offloads).

    src, dst          [P, num_blocks, E] int32 views: P pieces of a block (layers x K/V), E
                      words each, any piece and block strides, words contiguous. One of them
                      is the GPU's cache, the other page-locked host memory registered with
                      cudaHostRegister, which the GPU addresses at the host address
    src_ids, dst_ids  [N] int64 on the GPU: dst's block dst_ids[i] = src's block src_ids[i]

Grid (N, P): a program copies one piece, BLOCK words at a time. A block of an 8B model is 64
pieces of 32 KiB; as separate cudaMemcpy calls those moved about 2 GB/s on an H200's host
link that a single large copy crosses at about 55 GB/s (bench/results/kv_tiers_h200.json,
`pinned_copy`). Reference: `copy_blocks_ref`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 2048        # words a program moves per iteration (8 KiB)


class HostWords:
    """A host tensor as a Triton pointer argument: its address, which CUDA maps into the
    GPU's address space once the memory is registered (actors/pool_shm.py `_pin`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


@triton.jit
def _copy_blocks_kernel(Src, Dst, SrcIds, DstIds, stride_sp, stride_sb, stride_dp, stride_db,
                        words, BLOCK: tl.constexpr):
    i, piece = tl.program_id(0), tl.program_id(1).to(tl.int64)
    src = Src + piece * stride_sp + tl.load(SrcIds + i) * stride_sb
    dst = Dst + piece * stride_dp + tl.load(DstIds + i) * stride_db
    for w0 in range(0, words, BLOCK):
        offs = w0 + tl.arange(0, BLOCK)
        mask = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def as_words(kv: torch.Tensor) -> torch.Tensor:
    """A [layers, 2, blocks, ...] cache as [layers * 2, blocks, words] int32."""
    pieces = kv.flatten(0, 1)
    return pieces.reshape(pieces.shape[0], pieces.shape[1], -1).view(torch.int32)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> None:
    """dst's blocks dst_ids[i] = src's src_ids[i], both [layers, 2, blocks, ...] caches of one
    layout, one on the current GPU and one registered host memory; launched on the current
    stream (the caller synchronizes)."""
    gpu = src.device if src.device.type == "cuda" else dst.device
    s, d = as_words(src), as_words(dst)
    ids = torch.tensor([list(src_ids), list(dst_ids)], dtype=torch.int64).to(gpu,
                                                                             non_blocking=True)
    # (Both on the CPU only under Triton's interpreter, the tests' CPU run.)
    args = [HostWords(t) if t.device.type == "cpu" and gpu.type == "cuda" else t
            for t in (s, d)]
    _copy_blocks_kernel[(len(src_ids), s.shape[0])](
        *args, ids[0], ids[1], s.stride(0), s.stride(1), d.stride(0), d.stride(1), s.shape[2],
        BLOCK=BLOCK, num_warps=4)


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int],
                    dst_ids: Sequence[int]) -> None:
    """`copy_blocks` in torch."""
    dst[:, :, list(dst_ids)] = src[:, :, list(src_ids)].to(dst.device)
