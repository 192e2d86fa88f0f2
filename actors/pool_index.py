"""The DistributedKVCache's index: pool blocks by key, least recently used first.

Keys are the engines' chained prefix block hashes (`prompt_keys`), so a block one prefill
engine put is found by any engine whose prompt shares that prefix; a prompt's partial last
block has no such hash and goes under a RequestKey, private to its request.

As the KV tiers' host tier (docs/kv_tiers.md) the index also records which prefix hashes it
stores and drops (`events`, a PrefixEventLog the engines mirror into their reports) and hands
every block it evicts to `on_evict` first (the pool writes it to the disk tier).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from pd_cluster.block_allocator import PrefixEventLog, prefix_block_hashes

Key = Hashable  # a prefix block hash (int or bytes), or a RequestKey


class RequestKey(NamedTuple):
    """The key of a block only one request reads: its prompt's partial last block, which has
    no prefix hash. It lives as long as that request's hold."""

    request_id: str
    block: int


def prompt_keys(request_id: str, prompt_ids: Sequence[int], block_size: int,
                salt: str | None = None) -> list[Key]:
    """One key per block of a prompt: the chained prefix hash of each full block under the
    request's cache salt (the engines' own, so P, D and the pool agree), then a RequestKey
    for a partial last block."""
    keys: list[Key] = list(prefix_block_hashes(prompt_ids, block_size, salt))
    if len(prompt_ids) % block_size:
        keys.append(RequestKey(request_id, len(keys)))
    return keys


class BlockIndex:
    """Pool blocks by key, least recently used first; pinned blocks are never evicted.

    A block is exactly one of: free, reserved (being written, not yet findable), cached, or
    orphaned (its key dropped while a reader still has it pinned).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))   # taken from the end
        self.cached: OrderedDict[Key, int] = OrderedDict()  # oldest first
        self.pins: dict[int, int] = {}
        self.orphans: set[int] = set()  # dropped while pinned: freed at their last unpin
        self.hits = self.misses = self.evictions = 0
        self.events: PrefixEventLog | None = None       # prefix hashes stored / dropped
        self.on_evict: Callable[[Key, int], None] | None = None   # (key, block) evicted

    def allocate(self, n: int) -> list[int]:
        """Up to n blocks, evicting unpinned cached blocks (oldest first) when none are free."""
        while len(self.free_ids) < n and self._evict_one():
            pass
        # From the end of the list: O(n), where a pool of millions of small blocks would copy
        # the whole list each time. Ascending, so neighbours merge into one transfer
        # descriptor or copy (see BlockAllocator.allocate).
        cut = max(len(self.free_ids) - n, 0)
        taken = sorted(self.free_ids[cut:])
        del self.free_ids[cut:]
        return taken

    def _evict_one(self) -> bool:
        victim = next((k for k, b in self.cached.items() if b not in self.pins), None)
        if victim is None:
            return False
        block = self.cached.pop(victim)
        if self.on_evict is not None:   # before the block can be reused
            self.on_evict(victim, block)
        self._removed(victim)
        self.free_ids.append(block)
        self.evictions += 1
        return True

    def _removed(self, key: Key) -> None:
        if self.events is not None and isinstance(key, int):
            self.events.removed(key)

    def insert(self, keys: Sequence[Key], block_ids: Sequence[int]) -> list[int]:
        """Index blocks by key; returns the block now cached under each key."""
        for key, b in zip(keys, block_ids):
            if key in self.cached:  # two puts raced for a key: keep the older (maybe pinned) copy
                self.free_ids.append(b)
            else:
                self.cached[key] = b
                if self.events is not None and isinstance(key, int):
                    self.events.stored(key)
        return [self.cached[k] for k in keys]

    def drop(self, key: Key) -> None:
        """Forget a key; its block is freed now, or at its last unpin if someone reads it."""
        b = self.cached.pop(key, None)
        if b is None:
            return
        self._removed(key)
        if b in self.pins:
            self.orphans.add(b)
        else:
            self.free_ids.append(b)

    def prefix(self, keys: Sequence[Key]) -> list[int]:
        """Blocks of the longest cached prefix of keys, marked most recently used."""
        found = []
        for key in keys:
            if key not in self.cached:
                break
            self.cached.move_to_end(key)
            found.append(self.cached[key])
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        return found

    def pin(self, block_ids: Sequence[int], delta: int) -> None:
        for b in block_ids:
            left = self.pins.get(b, 0) + delta
            if left:
                self.pins[b] = left
                continue
            self.pins.pop(b, None)
            if b in self.orphans:
                self.orphans.discard(b)
                self.free_ids.append(b)
