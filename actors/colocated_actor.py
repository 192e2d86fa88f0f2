"""ColocatedActor: one engine that prefills and decodes its own requests (colocated mode).

Lifecycle of a request: see actors/streaming.py (generate → outputs → finished or abort);
chunked prefill and decode interleave in the engine's continuous batch, and the engine frees
the request's KV blocks when it finishes or is aborted. The actor is async, so a slow
subscriber never blocks another; the engine itself runs on the EngineLoop's thread.
"""
from __future__ import annotations

import ray

from actors.engine_loop import EngineLoop
from actors.streaming import StreamingEngine
from pd_cluster.config import EngineConfig
from pd_cluster.role import Role


@ray.remote
class ColocatedActor(StreamingEngine):
    def __init__(self, config: EngineConfig, replica_id: int,
                 stall_timeout_s: float = 600.0) -> None:
        self.loop = EngineLoop(config, stall_timeout_s, Role.DECODE, replica_id)
        self._open_outbox()
