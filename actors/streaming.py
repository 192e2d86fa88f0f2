"""StreamingEngine: what every engine actor that decodes for the router has in common.

Lifecycle of a request on such an actor (ColocatedActor, DecodingActor):
    generate(id, ids, params, sub) → the request joins the engine (prefilled here); returns
                                     once queued, or raises RequestRejected
    outputs(sub)                   → one Ray streaming generator per subscriber (a router
                                     replica), opened once: batches of (id, StreamDelta |
                                     StreamError) of all its requests, one per engine step
                                     at most (actors/outbox.py)
    abort(id)                      → the engine aborts it and frees its blocks; its last
                                     delta says finish_reason "abort"
    the subscriber goes away       → its unfinished requests are aborted
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import ray

from actors.engine_loop import EngineLoop
from actors.messages import STREAM_BACKPRESSURE, ReplicaLoad
from actors.outbox import Batch, Outbox
from pd_cluster.sampling_params import SamplingParams


class StreamingEngine:
    loop: EngineLoop

    def _open_outbox(self) -> None:
        self.outbox = Outbox(on_gone=lambda ids: [self.loop.abort(rid) for rid in ids])

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       sub: str) -> None:
        """Start a request here (prefill and decode); its outputs go to `sub`'s stream."""
        self.loop.submit(request_id, prompt_ids, params, self.outbox.queue(sub, request_id))

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE)
    async def outputs(self, sub: str) -> AsyncIterator[Batch]:
        """Every output of `sub`'s requests, batched (Ray streaming generator)."""
        async for batch in self.outbox.stream(sub):
            yield batch

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def load(self) -> ReplicaLoad:
        """The engine's latest load report (see EngineLoop.load)."""
        return self.loop.load()
