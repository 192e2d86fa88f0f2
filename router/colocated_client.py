"""ColocatedClient: the EngineClient over N ColocatedActor handles (colocated mode).

A request: open its queue in OutputStreams → actor.generate → its deltas from the actor's
one output stream to this replica → finished (or aborted on the actor if left early)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from actors.colocated_actor import ColocatedActor
from actors.messages import StreamAccumulator
from pd_cluster.config import EngineConfig
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams
from router.app_config import AppConfig
from router.output_streams import OutputStreams
from router.routing import ReplicaLoad, Route

# Load queries slower than this fail; the router keeps its previous reports meanwhile.
LOAD_TIMEOUT_S = 5.0


class ColocatedClient:
    """Sends each request to the engine its Route names (Route.decode_id; no prefill role)."""

    def __init__(self, actors: Sequence[Any], timeout_s: float = 600.0) -> None:
        self.actors = list(actors)
        self.timeout_s = timeout_s           # longest wait for a request's next output
        self.streams = OutputStreams()
        self._where: dict[str, int] = {}     # request id → replica, while it streams

    @classmethod
    def start(cls, config: AppConfig, engine: EngineConfig,
              actor_options: Mapping[str, dict[str, Any]]) -> ColocatedClient:
        """One ColocatedActor per decode replica (colocated engines take the decode role)."""
        options, timeout = actor_options["decode"], float(config.limits.request_timeout_s)
        return cls([ColocatedActor.options(**options).remote(engine, i, timeout)
                    for i in range(config.num_decode)], timeout)

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(asyncio.gather(*[a.load.remote() for a in self.actors]),
                               timeout_s)
        await asyncio.gather(*[self.streams.subscribe(i, a, timeout_s)
                               for i, a in enumerate(self.actors)])

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, route: Route) -> AsyncIterator[RequestOutput]:
        actor = self.actors[route.decode_id]
        self._where[request_id] = route.decode_id
        finished = False
        try:
            await self.streams.open(request_id, route.decode_id, actor)
            await actor.generate.remote(request_id, prompt_token_ids, params, self.streams.sub)
            acc = StreamAccumulator(request_id, prompt_token_ids)
            async for delta in self.streams.deltas(request_id, self.timeout_s):
                out = acc.add(delta)
                finished = out.finished
                yield out
        finally:
            self.streams.close(request_id)
            self._where.pop(request_id, None)
            if not finished:
                # Fire and forget: this may run while the caller is being cancelled.
                actor.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None:
            await self.actors[replica].abort.remote(request_id)

    async def loads(self) -> list[ReplicaLoad]:
        refs = [actor.load.remote() for actor in self.actors]
        return list(await asyncio.wait_for(asyncio.gather(*refs), LOAD_TIMEOUT_S))
