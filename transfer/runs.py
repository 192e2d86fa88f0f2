"""Block ids → merged byte runs (or per-block descriptor indices) of a KV cache.

A KV cache is one tensor [num_layers, parts, num_blocks, block_size, kv_heads, head_dim], parts
2 (K, V) or 1 (a latent cache, pd_cluster/kv_layout.py), so for one (layer, part) region the
blocks are laid out back to back:

    layer 0 K: | b0 | b1 | b2 | ... | b(N-1) |   layer 0 V: | b0 | b1 | ... |   layer 1 K: ...

Blocks that are consecutive on BOTH sides (src ids 4,5,6 → dst ids 10,11,12) merge into one
(src offset, dst offset, length) copy, which is what keeps descriptor counts (and per-descriptor
overheads of NIXL/UCX) small: a 2048-token prompt in contiguous blocks is 2 runs per layer.

A KV cache of several head-window shards (transfer/shards.py) moves per `Segment` (heads of
one destination shard that one source shard holds): when both windows are exactly the
segment's heads, whole blocks move as above; otherwise each (layer, K|V, block) is
block_size runs, one per token position, of count × head_dim × itemsize bytes:

    source [.., token, Hs heads, d]:  | h0 h1 | h0 h1 | ...      (token 0, token 1, ...)
    dest   [.., token, Hd heads, d]:  | h0 h1 h2 h3 | h0 h1 h2 h3 | ...
                                        ^^^^^ one run per token

Everything here is numpy-vectorised: these functions run once per transfer, i.e. once per
layer in a layer-wise push, and a Python loop over blocks cost more than the posting itself.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pd_cluster.kv_layout import KVLayout
from transfer.shards import Segment, starts

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


def _regions(layers: range, layout: KVLayout) -> np.ndarray:
    """(layer, part) region numbers of `layers`, as a column: region r = layer * parts + part
    (parts: 2 for K and V, 1 for a latent cache; both sides agree on it, KVLayout.mismatch)."""
    p = layout.parts
    return np.arange(p * layers.start, p * layers.stop, dtype=np.int64)[:, None]


def _block_runs(src: KVLayout, dst: KVLayout, layers: range,
                runs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """[n, 3] (src offset, dst offset, length) of whole-block runs (`_run_arrays`' result)."""
    s, d, n = runs
    reg, nb = _regions(layers, src), src.block_bytes
    out = np.empty((len(reg), len(n), 3), dtype=np.int64)
    out[..., 0] = (reg * src.num_blocks + s) * nb
    out[..., 1] = (reg * dst.num_blocks + d) * nb
    out[..., 2] = n * nb
    return out.reshape(-1, 3)


def _head_runs(src: KVLayout, dst: KVLayout, seg: Segment, layers: range, s: np.ndarray,
               d: np.ndarray) -> np.ndarray:
    """[n, 3] runs of heads [seg.head, + seg.count) of every token of blocks s → d, in
    (layer, K|V, block, token) order: address order on both sides."""
    reg = _regions(layers, src)[:, :, None]                     # [R, 1, 1]
    tok = np.arange(src.block_size, dtype=np.int64)              # [bs]
    hb = src.head_bytes
    out = np.empty((reg.shape[0], s.size, src.block_size, 3), dtype=np.int64)
    for col, lay, ids in ((0, src, s), (1, dst, d)):
        rows = (reg * lay.num_blocks + ids[None, :, None]) * lay.block_size + tok   # [R, N, bs]
        out[..., col] = (rows * lay.num_kv_heads + (seg.head - lay.head_start)) * hb
    out[..., 2] = seg.count * hb
    return out.reshape(-1, 3)


def byte_runs(src: KVLayout, dst: KVLayout, layers: range, src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> list[Copy]:
    """The copies that move `src_blocks` of `layers` into `dst_blocks` (the two KV caches may
    differ in size)."""
    runs = _run_arrays(*_checked(src, dst, layers, src_blocks, dst_blocks))
    out = _block_runs(src, dst, layers, runs)
    return list(zip(*(out[:, i].tolist() for i in range(3)))) if out.size else []


def shard_copies(src: Sequence[KVLayout], dst: Sequence[KVLayout], segments: Sequence[Segment],
                 layers: range, src_blocks: Sequence[int],
                 dst_blocks: Sequence[int]) -> np.ndarray:
    """[n, 3] int64 (src offset, dst offset, length) moving `src_blocks` of `layers` of the
    source shards into `dst_blocks` of the destination shards, offsets over each side's
    virtual concatenation of shards; `segments`: `head_sources(src, dst)`. One shard each
    side with the same heads: exactly `byte_runs`."""
    s, d = _checked(src[0], dst[0], layers, src_blocks, dst_blocks)
    if len(src) == len(dst) == 1 and segments[0].whole(src, dst):
        # Two unsharded caches (or one window each, the same): the hot path, kept lean.
        return _block_runs(src[0], dst[0], layers, _run_arrays(s, d))
    s_at, d_at = starts(src), starts(dst)
    merged, parts = None, []
    for seg in segments:
        sl, dl = src[seg.src], dst[seg.dst]
        if seg.whole(src, dst):
            merged = merged if merged is not None else _run_arrays(s, d)
            part = _block_runs(sl, dl, layers, merged)
        else:
            part = _head_runs(sl, dl, seg, layers, s, d)
        part[:, 0] += s_at[seg.src]
        part[:, 1] += d_at[seg.dst]
        parts.append(part)
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)


def block_indices(src: KVLayout, dst: KVLayout, layers: range, src_blocks: Sequence[int],
                  dst_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-block descriptor indices (int32) into each KV cache's list of (layer, K|V, block)s.

    Index (layer * parts + part) * num_blocks + block is that block's byte offset / block_bytes, so
    a descriptor list with one block_bytes entry per index covers the KV cache in address order
    and its consumer (NIXL) can merge neighbouring indices back into runs.
    """
    s, d = _checked(src, dst, layers, src_blocks, dst_blocks)
    reg = _regions(layers, src)
    return ((reg * src.num_blocks + s).ravel().astype(np.int32),
            (reg * dst.num_blocks + d).ravel().astype(np.int32))


def shard_block_indices(src: Sequence[KVLayout], dst: Sequence[KVLayout],
                        segments: Sequence[Segment], layers: range, src_blocks: Sequence[int],
                        dst_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """`block_indices` over shards whose segments are all `whole` (identical windows): shard
    i's descriptors follow shard i - 1's in each side's list (i * layers * parts * num_blocks)."""
    s, d = _checked(src[0], dst[0], layers, src_blocks, dst_blocks)
    reg = _regions(layers, src[0])
    per_s, per_d = (lay.parts * lay.num_layers * lay.num_blocks for lay in (src[0], dst[0]))
    s_idx, d_idx = (reg * src[0].num_blocks + s).ravel(), (reg * dst[0].num_blocks + d).ravel()
    if len(segments) == 1 and segments[0].src == segments[0].dst == 0:
        return s_idx.astype(np.int32), d_idx.astype(np.int32)
    return (np.concatenate([s_idx + g.src * per_s for g in segments]).astype(np.int32),
            np.concatenate([d_idx + g.dst * per_d for g in segments]).astype(np.int32))
