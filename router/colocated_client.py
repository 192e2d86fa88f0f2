"""ColocatedClient: the EngineClient over colocated engine replicas (ColocatedActor).

A request: open its queue in OutputStreams → actor.generate → its deltas from the actor's
one output stream to this replica → finished (or aborted on the actor if left early). The
replicas come from a Membership (`update`), like DisaggregatedClient's; a dead replica fails
the requests on it (colocated engines hold their requests' whole KV: nothing to migrate)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray.exceptions import RayActorError

from actors.messages import StreamAccumulator
from pd_cluster.config import EngineConfig
from pd_cluster.outputs import RequestOutput
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from router.app_config import AppConfig
from router.control.fleet import EngineFleet
from router.control.membership import Membership, ReplicaTable
from router.engine_client import table_loads
from router.output_streams import OutputStreams
from router.routing import ReplicaLoad, Route


class ColocatedClient:
    """Sends each request to the engine its Route names (Route.decode_id; no prefill role)."""

    def __init__(self, timeout_s: float = 600.0, fleet: EngineFleet | None = None) -> None:
        self.timeout_s, self.fleet = timeout_s, fleet   # timeout: longest wait for an output
        self.table = ReplicaTable()
        self.streams = OutputStreams()
        self._where: dict[str, int] = {}     # request id → replica, while it streams

    def __getstate__(self) -> dict:
        return {**self.__dict__, "fleet": None}

    @property
    def actors(self) -> list[Any]:
        """The engines' actors, by replica id (tests, benchmarks)."""
        return self.table.by_id(Role.DECODE)

    @classmethod
    def start(cls, config: AppConfig, engine: EngineConfig,
              actor_options: Mapping[Role, dict[str, Any]]) -> ColocatedClient:
        """A client over engines of its own (an unsupervised fleet; colocated engines take
        the decode role), brought up by wait_ready."""
        fleet = EngineFleet.for_app(config, engine, actor_options, supervise=False)
        return cls(float(config.limits.request_timeout_s), fleet)

    async def wait_ready(self, timeout_s: float) -> None:
        self.update(await self.fleet.wait_serving(timeout_s))
        await asyncio.gather(*[self.streams.subscribe(key, a, timeout_s)
                               for key, a in self.table.keyed()])

    def update(self, membership: Membership) -> None:
        self.table.update(membership)

    @property
    def dead(self) -> set[tuple[Role, int]]:
        """Replicas this client found dead and the membership has not replaced yet."""
        return self.table.dead

    def available(self) -> set[tuple[Role, int]]:
        return self.table.available()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, route: Route) -> AsyncIterator[RequestOutput]:
        actor = self.table.actors[Role.DECODE][route.decode_id]
        self._where[request_id] = route.decode_id
        finished = False
        try:
            await self.streams.open(request_id, (Role.DECODE, route.decode_id), actor)
            await actor.generate.remote(request_id, prompt_token_ids, params, self.streams.sub)
            acc = StreamAccumulator(request_id, prompt_token_ids)
            async for delta in self.streams.deltas(request_id, self.timeout_s):
                out = acc.add(delta)
                finished = out.finished
                yield out
        except RayActorError:
            self.table.mark_dead((Role.DECODE, route.decode_id))
            raise
        finally:
            self.streams.close(request_id)
            self._where.pop(request_id, None)
            if not finished:
                # Fire and forget: this may run while the caller is being cancelled.
                actor.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None:
            await self.table.actors[Role.DECODE][replica].abort.remote(request_id)

    async def loads(self, cursors: Mapping[tuple[Role, int], int] | None = None
                    ) -> list[ReplicaLoad]:
        return await table_loads(self.table, cursors)
