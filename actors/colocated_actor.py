"""ColocatedActor: one engine that prefills and decodes its own requests (colocated mode).

Lifecycle of a request:
    generate(id, ids, params)  → added to the actor's EngineLoop; a Ray streaming generator
                                 yields each RequestOutput as the engine produces it
    (chunked prefill and decode interleave in the engine's continuous batch)
    last output finished       → the generator returns; the engine has freed the KV blocks
    abort(id) / caller gone    → the engine aborts the request and frees its blocks; the
                                 stream ends with a finished output (finish_reason "abort")
Callers: `actor.generate.options(num_returns="streaming").remote(...)`, consumed with
`async for ref in gen: out = await ref`. The actor is async, so one slow stream never
blocks another; the engine itself runs on the EngineLoop's thread.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.engine_loop import EngineLoop
from actors.messages import STREAM_BACKPRESSURE, StreamDelta
from pd_cluster.config import EngineConfig
from pd_cluster.sampling_params import SamplingParams


@ray.remote
class ColocatedActor:
    def __init__(self, config: EngineConfig, replica_id: int,
                 stall_timeout_s: float = 600.0) -> None:
        self.replica_id = replica_id
        self.loop = EngineLoop(config, stall_timeout_s)

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE)
    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StreamDelta]:
        """Stream the request's outputs (Ray streaming generator)."""
        async for out in self.loop.stream(request_id, prompt_ids, params):
            yield StreamDelta.of(out)

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def load(self) -> dict[str, Any]:
        """The engine's load snapshot plus this replica's id (see EngineLoop.load)."""
        return {**self.loop.load(), "replica_id": self.replica_id}
