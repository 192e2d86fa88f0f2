"""ColocatedActor: one engine that prefills and decodes its own requests (colocated mode).

Lifecycle of a request: see actors/streaming.py (generate → outputs → finished or abort);
chunked prefill and decode interleave in the engine's continuous batch, and the engine frees
the request's KV blocks when it finishes or is aborted. The actor is async, so a slow
subscriber never blocks another; the engine itself runs on the EngineLoop's thread.
"""
from __future__ import annotations

import ray

from actors.engine_lease import EngineLease
from actors.engine_loop import EngineLoop
from actors.streaming import StreamingEngine
from pd_cluster.config import EngineConfig
from pd_cluster.role import Role


@ray.remote
class ColocatedActor(StreamingEngine):
    def __init__(self, config: EngineConfig, replica_id: int,
                 stall_timeout_s: float = 600.0, engine_lease_s: float | None = None) -> None:
        self.loop = EngineLoop(config, stall_timeout_s, Role.DECODE, replica_id)
        self._open_outbox()
        self.lease = (None if engine_lease_s is None
                      else EngineLease(f"colocated-{replica_id}", engine_lease_s))

    async def renew_lease(self) -> float:
        """Renew this actor's lease (actors/engine_lease.py); returns its length."""
        return 0.0 if self.lease is None else self.lease.renew()
