"""Fixed-size KV blocks with ref counts, a prefix-hash index and lazy LRU eviction.

    free queue (LRU first)          hash index
    [7] [3] [12] [5] ...            h(parent, tokens) -> block
     ^ evicted next                 (a free block keeps its hash until it is reused)

A block whose ref count drops to 0 goes to the tail of the free queue but stays in the hash
index, so a later request with the same prefix can revive it. Only when the queue hands it out
for new content is its hash dropped ("lazy eviction").

With the KV tiers on (`collect_offloads`), a block is also listed in `offloads` as it is
cached under its hash (write-through): the engine's actor copies it to its node's host tier
(actors/kv_tiers.py) within milliseconds, taking a reference meanwhile, so it is down before
any eviction could reuse it and the step never waits for the copy (docs/kv_tiers.md).

Routers learn what a cache holds from its events (like vLLM's KV cache events): once an
engine's owner calls `record_events`, every hash registered in the index is recorded as
stored and every hash dropped from it as removed, in a PrefixEventLog.
"""
from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: stable across processes (P, D and the KV pool agree)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(salt: str | None) -> int | None:
    """The parent of a prompt's first block: None unsalted, else a hash of the cache salt
    (SamplingParams.cache_salt), so prompts of different salts never share a block hash:
    not in a prefix cache, the KV pool, the KV tiers or a router's view of them."""
    if salt is None:
        return None
    h = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8,
                        person=b"pd-cache-salt")
    return int.from_bytes(h.digest(), "little") | 1      # never 0, the unsalted parent


def prefix_block_hashes(token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> list[int]:
    """Hashes of every full block of `token_ids`, each chained on the previous one (the first
    on the salt's root)."""
    hashes: list[int] = []
    parent = salt_root(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


# Fewest events a PrefixEventLog keeps, whatever the cache's size.
MIN_EVENT_LOG = 1024
# Host-tier events are the hash plus this bit (hashes are 64-bit), so they share the one
# numbered stream with the GPU cache's and net out apart from them.
HOST_BIT = 1 << 64


class PrefixChanges(NamedTuple):
    """How a prefix cache changed after sequence number `since` (PrefixEventLog.changes)."""

    since: int            # -1: a snapshot, `stored` is every cached hash
    cursor: int           # sequence number of the last event included
    stored: list[int]     # hashes cached now that were not at `since`
    removed: list[int]    # hashes cached at `since` that are not now
    # The KV tiers: hashes the node's host tier holds now that it did not at `since` (a
    # snapshot: all of them), and those it held then and does not now.
    offloaded: list[int]
    unloaded: list[int]


class PrefixEventLog:
    """The prefix cache's stored and removed block hashes, numbered 1, 2, ... (the cursor is
    the number of the last one), for the reports routers poll.

    Lifecycle: the engine thread records events while it steps (`stored`, `removed`,
    `cleared`: appends to a private list, no lock, O(1) each) and `publish`es them after each
    step: one lock per step numbers them, appends them to the bounded log and applies them to
    a mirror of the cached hashes. Any thread then reads `changes(since)`: the net changes
    after `since`, or a snapshot of the mirror once the log no longer reaches back that far.
    The log keeps between `capacity` and twice as many events (trimmed in bulk, amortized
    O(1) per event). An event is a hash `h` (stored) or `~h` (removed; hashes are >= 0);
    with the KV tiers also `h + HOST_BIT` (offloaded: the node's host tier holds it) or
    `~(h + HOST_BIT)` (unloaded: it no longer does), which a clearing of the GPU cache keeps.
    """

    def __init__(self, capacity: int, cached: Iterable[int] = ()) -> None:
        self.capacity = capacity
        # This engine instance: a restarted replica's events start over under a new epoch.
        self.epoch = secrets.randbits(63)
        self._pending: list[int] = []          # the engine thread's, until published
        self._reset = False                    # the cache was cleared since the last publish
        self._lock = threading.Lock()
        self._events: list[int] = []           # published; _events[i] is number _first + i
        self._first = 1
        self._cursor = 0
        self._cached: set[int] = set(cached)   # the hashes cached as of _cursor
        self._host: set[int] = set()           # held by the host tier as of _cursor

    def stored(self, block_hash: int) -> None:
        self._pending.append(block_hash)

    def removed(self, block_hash: int) -> None:
        self._pending.append(~block_hash)

    def offloaded(self, block_hash: int) -> None:
        self._pending.append(block_hash + HOST_BIT)

    def unloaded(self, block_hash: int) -> None:
        self._pending.append(~(block_hash + HOST_BIT))

    def cleared(self) -> None:
        """Every hash left the cache at once: readers get a snapshot (of what follows)."""
        self._pending.clear()
        self._reset = True

    def publish(self) -> None:
        """Make the recorded events visible to `changes` (engine thread, after each step)."""
        if not self._pending and not self._reset:
            return
        pending, self._pending = self._pending, []
        with self._lock:
            if self._reset:
                # One number for the clearing; no window may span it, so any cursor before it
                # gets a snapshot.
                self._reset = False
                self._cached.clear()              # (the host tier is not this cache)
                self._events.clear()
                self._cursor += 1
                self._first = self._cursor + 1
            cached, host = self._cached, self._host
            for event in pending:
                value = event if event >= 0 else ~event
                held = host if value >= HOST_BIT else cached
                if event >= 0:
                    held.add(value & (HOST_BIT - 1))
                else:
                    held.discard(value & (HOST_BIT - 1))
            self._events += pending
            self._cursor += len(pending)
            excess = len(self._events) - self.capacity
            if excess >= self.capacity:
                del self._events[:excess]
                self._first += excess

    @property
    def cursor(self) -> int:
        """Number of the last published event."""
        with self._lock:
            return self._cursor

    def changes(self, since: int) -> PrefixChanges:
        """The net changes after event `since` (any thread); a snapshot when `since` is -1,
        older than the log or newer than the cursor (a cursor of another engine instance)."""
        with self._lock:
            cursor = self._cursor
            if since < 0 or since > cursor or since < self._first - 1:
                return PrefixChanges(-1, cursor, list(self._cached), [], list(self._host), [])
            window = self._events[since - self._first + 1:]
        # A hash's events alternate (stored, removed, stored...), so two in a row cancel out:
        # what is left of a hash is its one net change, if any (host-tier ones apart).
        net: dict[int, bool] = {}
        for event in window:
            block_hash = event if event >= 0 else ~event
            if net.pop(block_hash, None) is None:
                net[block_hash] = event >= 0
        low = HOST_BIT - 1
        return PrefixChanges(
            since, cursor, [h for h, s in net.items() if s and h < HOST_BIT],
            [h for h, s in net.items() if not s and h < HOST_BIT],
            [h & low for h, s in net.items() if s and h >= HOST_BIT],
            [h & low for h, s in net.items() if not s and h >= HOST_BIT])


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
        self.events: PrefixEventLog | None = None   # see record_events
        self.offloads: list[Block] | None = None    # see collect_offloads

    def collect_offloads(self) -> None:
        """From now on list in `offloads` each block as it is cached under its hash (the KV
        tiers' candidates to copy down; their owner empties the list). Listed when cached,
        not when freed: a busy engine reallocates a freed block within milliseconds, before
        a copy could take it, and the prefix behind it would be lost to every tier."""
        if self.offloads is None:
            self.offloads = []

    def record_events(self, capacity: int | None = None) -> PrefixEventLog:
        """Record from now on which hashes the index stores and removes (once; before the
        engine steps on another thread). `capacity` defaults to the block count, at least
        MIN_EVENT_LOG: past that many events an incremental report would be about as large
        as a snapshot (the cache holds at most that many hashes)."""
        if self.events is None:
            self.events = PrefixEventLog(capacity or max(self.num_blocks, MIN_EVENT_LOG),
                                         self._by_hash)
        return self.events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached prompt prefix (held by requests or free)."""
        return len(self._by_hash)

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
            if self.events is not None:
                self.events.stored(block_hash)
            if self.offloads is not None:
                self.offloads.append(block)

    def reset_prefix_cache(self) -> None:
        for block in self._by_hash.values():
            block.block_hash, block.token_ids = None, ()
        self._by_hash.clear()
        if self.events is not None:
            self.events.cleared()

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash, block.token_ids = None, ()
