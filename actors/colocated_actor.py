"""ColocatedActor: one engine that prefills and decodes its own requests (colocated mode).

Lifecycle of a request: see actors/streaming.py (generate → outputs → finished or abort);
chunked prefill and decode interleave in the engine's continuous batch, and the engine frees
the request's KV blocks when it finishes or is aborted. The actor is async, so a slow
subscriber never blocks another; the engine itself runs on the EngineLoop's thread. With
`kv_tiers`, a prompt's prefix is first loaded from the node's KV tiers where that beats
computing it, and the blocks the engine frees are written down to them (actors/kv_tiers.py).
"""
from __future__ import annotations

import ray

from actors.engine_lease import EngineLease
from actors.engine_loop import EngineLoop
from actors.kv_tier_engine import TieredEngine
from actors.messages import ReplicaLoad
from actors.streaming import StreamingEngine
from pd_cluster.config import EngineConfig
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams


@ray.remote
class ColocatedActor(StreamingEngine, TieredEngine):
    def __init__(self, config: EngineConfig, replica_id: int,
                 stall_timeout_s: float = 600.0, engine_lease_s: float | None = None,
                 kv_tiers: object = None) -> None:
        """`kv_tiers`: a KVTiersConfig (router/app_sections.py) to keep evicted prefix
        blocks in the node's host and disk tiers (actors/kv_tiers.py); None: off."""
        self.loop = EngineLoop(config, stall_timeout_s, Role.DECODE, replica_id)
        self._init_tiers(kv_tiers)
        self._open_outbox()
        self.lease = (None if engine_lease_s is None
                      else EngineLease(f"colocated-{replica_id}", engine_lease_s))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       sub: str) -> None:
        """StreamingEngine.generate, the prompt's prefix first loaded from the KV tiers
        where that beats computing it (held until the request is queued)."""
        kept = await self._tier_reuse(prompt_ids, params.cache_salt)
        try:
            await StreamingEngine.generate(self, request_id, prompt_ids, params, sub)
        finally:
            self._tier_release(kept)    # queued after the request (kv_tier_engine.py: why)

    async def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """StreamingEngine.load, with the KV tiers' counters when they are on."""
        return self._with_tiers(self.loop.load(prefix_since))

    async def renew_lease(self) -> float:
        """Renew this actor's lease (actors/engine_lease.py); returns its length."""
        return 0.0 if self.lease is None else self.lease.renew()
