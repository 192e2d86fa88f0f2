"""Block ids → merged byte runs (or per-block descriptor indices) of a KV cache.

A KV cache is one tensor [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim], so
for one (layer, K|V) pair the blocks are laid out back to back:

    layer 0 K: | b0 | b1 | b2 | ... | b(N-1) |   layer 0 V: | b0 | b1 | ... |   layer 1 K: ...

Blocks that are consecutive on BOTH sides (src ids 4,5,6 → dst ids 10,11,12) merge into one
(src offset, dst offset, length) copy, which is what keeps descriptor counts (and per-descriptor
overheads of NIXL/UCX) small: a 2048-token prompt in contiguous blocks is 2 runs per layer.

Everything here is numpy-vectorised: these functions run once per transfer, i.e. once per
layer in a layer-wise push, and a Python loop over blocks cost more than the posting itself.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pd_cluster.kv_layout import KVLayout

Copy = tuple[int, int, int]  # (src byte offset, dst byte offset, byte length)


def _ids(blocks: Sequence[int], layout: KVLayout) -> np.ndarray:
    ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    # As uint64 a negative id is huge, so one max() checks both ends.
    if ids.size and ids.view(np.uint64).max() >= layout.num_blocks:
        bad = ids[(ids < 0) | (ids >= layout.num_blocks)]
        raise ValueError(f"block ids {bad[:4].tolist()} out of range for a KV cache of "
                         f"{layout.num_blocks}")
    return ids


def _checked(src: KVLayout, dst: KVLayout, layers: range, src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    if layers.start < 0 or layers.stop > src.num_layers or layers.step != 1:
        raise ValueError(f"layers {layers} not a contiguous range within {src.num_layers} layers")
    return _ids(src_blocks, src), _ids(dst_blocks, dst)


def _run_arrays(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, counts) of maximal runs contiguous on both sides."""
    if not src.size:
        return src, dst, src
    # A run starts wherever either side does not continue the previous block.
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], counts


def _regions(layers: range) -> np.ndarray:
    """(layer, K|V) region numbers of `layers`, as a column: region r = layer * 2 + kv."""
    return np.arange(2 * layers.start, 2 * layers.stop, dtype=np.int64)[:, None]


def byte_runs(src: KVLayout, dst: KVLayout, layers: range, src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> list[Copy]:
    """The copies that move `src_blocks` of `layers` into `dst_blocks` (the two KV caches may
    differ in size)."""
    s, d, n = _run_arrays(*_checked(src, dst, layers, src_blocks, dst_blocks))
    reg, nb = _regions(layers), src.block_bytes
    cols = [((reg * layout.num_blocks + start) * nb).ravel()
            for layout, start in ((src, s), (dst, d))]
    lengths = np.broadcast_to(n * nb, (len(reg), len(n))).ravel()
    return list(zip(cols[0].tolist(), cols[1].tolist(), lengths.tolist()))


def block_indices(src: KVLayout, dst: KVLayout, layers: range, src_blocks: Sequence[int],
                  dst_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-block descriptor indices (int32) into each KV cache's list of (layer, K|V, block)s.

    Index (layer * 2 + kv) * num_blocks + block is that block's byte offset / block_bytes, so
    a descriptor list with one block_bytes entry per index covers the KV cache in address order
    and its consumer (NIXL) can merge neighbouring indices back into runs.
    """
    s, d = _checked(src, dst, layers, src_blocks, dst_blocks)
    reg = _regions(layers)
    return ((reg * src.num_blocks + s).ravel().astype(np.int32),
            (reg * dst.num_blocks + d).ravel().astype(np.int32))
