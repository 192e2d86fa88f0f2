"""Block ids → merged byte runs of a KV pool.

A pool is one tensor [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim], so
for one (layer, K|V) pair the blocks are laid out back to back:

    layer 0 K: | b0 | b1 | b2 | ... | b(N-1) |   layer 0 V: | b0 | b1 | ... |   layer 1 K: ...

Blocks that are consecutive on BOTH sides (src ids 4,5,6 → dst ids 10,11,12) merge into one
(src offset, dst offset, length) copy, which is what keeps descriptor counts (and per-descriptor
overheads of NIXL/UCX) small: a 2048-token prompt in contiguous blocks is 2 runs per layer.
"""
from __future__ import annotations

from collections.abc import Sequence

from pd_cluster.kv_layout import KVLayout

Copy = tuple[int, int, int]  # (src byte offset, dst byte offset, byte length)


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) for maximal runs contiguous on both sides."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def block_offset(layout: KVLayout, layer: int, kv: int, block: int) -> int:
    """Byte offset of one block of one layer's K (kv=0) or V (kv=1) inside the pool tensor."""
    return ((layer * 2 + kv) * layout.num_blocks + block) * layout.block_bytes


def byte_runs(src: KVLayout, dst: KVLayout, layers: range, src_blocks: Sequence[int],
              dst_blocks: Sequence[int]) -> list[Copy]:
    """The copies that move `src_blocks` of `layers` into `dst_blocks` (pools may differ in size)."""
    for ids, layout in ((src_blocks, src), (dst_blocks, dst)):
        bad = [b for b in ids if not 0 <= b < layout.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} out of range for a pool of {layout.num_blocks}")
    if layers.start < 0 or layers.stop > src.num_layers or layers.step != 1:
        raise ValueError(f"layers {layers} not a contiguous range within {src.num_layers} layers")
    nb, runs = src.block_bytes, block_runs(src_blocks, dst_blocks)
    return [(block_offset(src, layer, kv, s), block_offset(dst, layer, kv, d), n * nb)
            for layer in layers for kv in (0, 1) for s, d, n in runs]
