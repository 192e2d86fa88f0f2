"""Fixed-size KV blocks with ref counts, a prefix-hash index and lazy LRU eviction.

    free queue (LRU first)          hash index
    [7] [3] [12] [5] ...            h(parent, tokens) -> block
     ^ evicted next                 (a free block keeps its hash until it is reused)

A block whose ref count drops to 0 goes to the tail of the free queue but stays in the hash
index, so a later request with the same prefix can revive it. Only when the queue hands it out
for new content is its hash dropped ("lazy eviction").
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: stable across processes (P, D and the KV pool agree)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids`, each chained on the previous one."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 token_ids[start:start + block_size]))
    return hashes


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept for the equality check on a hash hit


class BlockAllocator:
    """Owns every block of one engine's KV cache: hands them out, counts references, and
    indexes the full ones by prefix hash."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An OrderedDict is Python's O(1) doubly linked list: pop the LRU end, remove a revived
        # block from the middle, append on release.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, Block] = {}
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """A cached block holding exactly `token_ids` under `block_hash`, else None."""
        block = self._by_hash.get(block_hash) if self.enable_prefix_caching else None
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cached blocks (reviving free ones)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        """Hand out `n` blocks for new content, in ascending id order, evicting cached blocks
        about least recently freed first.

        Each KV transfer descriptor covers one run of consecutive blocks, so a request's blocks
        should form few runs: one descriptor per layer instead of one per block (a 2048-token
        prompt: 64 instead of 8,192, which saturated the prefill side's transport thread).
        Taking blocks strictly in free-queue order scatters them once the free queue has wrapped around
        (requests free tail first, and a decode engine's one-at-a-time growth blocks interleave
        with its prompt ranges). So each pick starts at the least recently freed block and takes
        the free run around it, downwards first (a request's freed range is queued tail first);
        the neighbours it takes were nearly always freed with it. The price: a cached block
        next to an old one can be evicted before LRU order would have taken it.
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self._free)} free")
        ids: list[int] = []
        while len(ids) < n:
            first = next(iter(self._free))
            lo = first
            while lo - 1 in self._free and first - lo + 1 < n - len(ids):
                lo -= 1
            hi = first
            while hi + 1 in self._free and hi - lo + 1 < n - len(ids):
                hi += 1
            for block_id in range(lo, hi + 1):
                del self._free[block_id]
            ids.extend(range(lo, hi + 1))
        out = [self.blocks[i] for i in sorted(ids)]
        for block in out:
            self._drop_hash(block)
            block.ref_count = 1
        return out

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; pass them tail first so tails are evicted first."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full block under its hash (the first block to claim a hash keeps it)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash not in self._by_hash:
            block.block_hash, block.token_ids = block_hash, tuple(token_ids)
            self._by_hash[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._by_hash.values():
            block.block_hash, block.token_ids = None, ()
        self._by_hash.clear()

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            block.block_hash, block.token_ids = None, ()
