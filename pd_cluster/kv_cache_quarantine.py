"""KV blocks fenced off from late writes: a decode engine's quarantine.

A decode engine reserves blocks that another engine then writes into (a layer-wise KV push).
When the reservation ends before the KV landed (abort, lease expiry, a failed transfer), the
writer may still have writes in flight; were the blocks freed at once, such a late write
could land in a block that already belongs to another request and corrupt its KV. So the
blocks the writer targets wait here, out of the free list, until the writer confirms that
none of its writes can land any more, or until the writer's lease plus a margin has passed
(a writer that died sends nothing, and its writes died with it).

Lifecycle of an entry (one per key, a request id; the writer names it in its notice):
    hold(key, blocks)   engine thread: HELD, deadline = now + window_s
        ├──► DRAINED    `drained(key)` (any thread: the transport's) came, and the next
        │               `settle()` (engine thread) hands the blocks back to be freed
        └──► EXPIRED    `settle()` at or after the deadline hands them back
A `drained(key)` that beats `hold(key)` is remembered for window_s, so the hold that
follows ends at once: the writer sends one at the end of every push, also when all its writes
landed, and a request dropped after that (a client gone after the first token, before the
decode engine saw the writes land) needs no wait.
Only the engine thread touches entries; other threads only append to the inbox.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

from pd_cluster.block_allocator import Block


class Release(Enum):
    DRAINED = "drained"   # the writer confirmed its writes all completed or failed
    EXPIRED = "expired"   # the deadline passed without a confirmation


@dataclass(slots=True)
class QuarantineStats:
    held: int = 0                   # holds, since start
    drained: int = 0                # of which ended by the writer's confirmation
    expired: int = 0                # of which ended by their deadline
    blocks: int = 0                 # blocks held now


@dataclass(eq=False, slots=True)
class _Held:
    blocks: list[Block]
    deadline: float


@dataclass(eq=False)
class KVQuarantine:
    """See the module docstring. `window_s`: how long a hold lasts without a confirmation
    (the writer's transport lease plus a margin)."""

    window_s: float
    stats: QuarantineStats = field(default_factory=QuarantineStats)

    def __post_init__(self) -> None:
        self._held: dict[str, list[_Held]] = {}
        self._ready: set[str] = set()           # held and confirmed: freed at the next settle
        self._early: dict[str, float] = {}      # confirmed before held: key → until when
        # Keys confirmed drained, appended by any thread (deque.append is atomic).
        self._inbox: collections.deque[str] = collections.deque()
        self._next_deadline = float("inf")

    def hold(self, key: str, blocks: Sequence[Block]) -> None:
        """Keep `blocks` (each with one reference, the request's) out of the free list."""
        if not blocks:
            return
        now = time.monotonic()
        self._take_inbox(now)    # a confirmation that came just before counts
        self._held.setdefault(key, []).append(_Held(list(blocks), now + self.window_s))
        self._next_deadline = min(self._next_deadline, now + self.window_s)
        self.stats.held += 1
        self.stats.blocks += len(blocks)
        if self._early.pop(key, 0.0) > now:
            self._ready.add(key)

    def drained(self, key: str) -> None:
        """The writer's writes to `key`'s blocks all ended (any thread)."""
        self._inbox.append(key)

    def settle(self) -> list[tuple[str, Release, list[Block]]]:
        """Engine thread: the holds that end now (confirmed, or past their deadline), as
        (key, why, blocks) for the caller to free. Cheap when nothing ends."""
        now = time.monotonic()
        if not self._inbox and not self._ready and now < self._next_deadline:
            return []
        self._take_inbox(now)
        out = [(key, Release.DRAINED, h.blocks) for key in self._ready
               for h in self._held.pop(key, ())]
        self._ready.clear()
        if now >= self._next_deadline:
            for key, holds in list(self._held.items()):
                out += [(key, Release.EXPIRED, h.blocks) for h in holds if h.deadline <= now]
                holds[:] = [h for h in holds if h.deadline > now]
                if not holds:
                    del self._held[key]
            self._early = {k: t for k, t in self._early.items() if t > now}
            self._next_deadline = min([h.deadline for hs in self._held.values() for h in hs]
                                      + [t for t in self._early.values()], default=float("inf"))
        for _, why, blocks in out:
            self.stats.blocks -= len(blocks)
            if why is Release.DRAINED:
                self.stats.drained += 1
            else:
                self.stats.expired += 1
        return out

    def _take_inbox(self, now: float) -> None:
        while self._inbox:
            key = self._inbox.popleft()
            if key in self._held:
                self._ready.add(key)
            else:
                self._early[key] = now + self.window_s
                self._next_deadline = min(self._next_deadline, now + self.window_s)

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def held_block_ids(self) -> set[int]:
        return {b.block_id for hs in self._held.values() for h in hs for b in h.blocks}
