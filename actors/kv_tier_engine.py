"""What an engine actor (ColocatedActor, EngineActor) adds for the KV tiers (docs/kv_tiers.md):
a TierClient (actors/kv_tiers.py) when kv_tiers is on, started at the actor's first load
report or request, whichever comes first; the loader's references released once the request
holds its blocks; and the tier counters in the actor's load report.

Lifecycle, per request: `_tier_reuse(prompt)` (the prefix loaded where worth it: blocks held)
→ `_tier_release(held)` as the request is queued (colocated: right after its submit; P and
D's own prefill: right before, the release queued on the engine thread ahead of the add;
D's reservation: after it, which takes the blocks itself). The freed blocks stay cached at
the tail of the allocator's LRU queue, where the request finds them when it is scheduled;
only a cache churned through its whole free list before then evicts them, and the prefix is
then computed. Holding them until the request ran instead (until its first output) let
queued requests hold a full cache between them with none able to start: a deadlock.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from actors.kv_tiers import TierClient, TierState
from actors.messages import ReplicaLoad
from pd_cluster.block_allocator import Block
from pd_cluster.kv_tiers import Tier

if TYPE_CHECKING:
    from actors.engine_loop import EngineLoop

log = logging.getLogger(__name__)

FLUSH_ROUNDS = 8



class TieredEngine:
    """What an engine actor (ColocatedActor, EngineActor) adds for the KV tiers: a TierClient
    when `kv_tiers` is given, started at its first use (an actor's __init__ cannot await)."""

    loop: EngineLoop

    def _init_tiers(self, kv_tiers: Any, timeout_s: float = 30.0) -> None:
        self.tiers = None if kv_tiers is None else TierClient(self.loop, kv_tiers, timeout_s)
        self._tiers_started: asyncio.Future | None = None

    async def _tier_reuse(self, prompt_ids: list[int], salt: str | None) -> list[Block]:
        """The prompt's prefix held (loaded from the tiers where worth it); [] with no
        tiers. Release with `_tier_release` once the request holds its blocks."""
        if self.tiers is None:
            return []
        self._start_tiers()
        try:
            await asyncio.shield(self._tiers_started)
        except Exception as e:  # noqa: BLE001 - off, not failed
            log.warning("KV tiers off for this engine: %s", e)
            self.tiers.state = TierState.OFF
        return await self.tiers.reuse(prompt_ids, salt)

    def _tier_release(self, kept: list[Block]) -> None:
        """Drop `_tier_reuse`'s references (queued on the engine thread, not waited for)."""
        if kept:
            asyncio.ensure_future(self.loop.call(lambda e: e.kv.release_blocks(kept)))

    async def tier_stats(self) -> dict:
        """This engine's tier counters (TierClient.stats), the cost rule's rates and its
        node's host tier's stats (`host_tier`, as last fetched); {} with no tiers."""
        return self._tier_report()

    def _tier_report(self) -> dict:
        if self.tiers is None:
            return {}
        t = self.tiers
        return {**t.stats, "state": t.state.value, "prefill_tokens_per_s": t.cost.prefill_tps,
                "host_gbps": t.cost.gbps[Tier.HOST], "disk_gbps": t.cost.gbps[Tier.DISK],
                "host_tier": dict(t.host_stats)}

    def _start_tiers(self) -> None:
        if self.tiers is not None and self._tiers_started is None:
            self._tiers_started = asyncio.ensure_future(self.tiers.start())

    def _with_tiers(self, load: ReplicaLoad) -> ReplicaLoad:
        """An engine's load report with its tier report (for the routers' metrics). The
        first report starts the tiers: the controller asks for one before any request
        comes, so the host tier is up (its memory reserved) before the first prompt."""
        if self.tiers is None:
            return load
        self._start_tiers()
        return dataclasses.replace(load, kv_tiers=self._tier_report())

    async def flush_tiers(self) -> int:
        """Offload what the engine has freed now, not at the next tick (tests, drains);
        returns how many blocks this engine has written down in all."""
        if self.tiers is None or self.tiers.state is not TierState.ON:
            return 0
        # A round takes at most half the free blocks: a few rounds empty the list.
        for _ in range(FLUSH_ROUNDS):
            await self.tiers._offload()
            if not self.loop.engine.kv.allocator.offloads:
                break
        return self.tiers.stats["offloaded"]
