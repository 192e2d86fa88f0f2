"""The router's one dependency on the engines: EngineClient, one per application.

Implementations: `router.colocated_client.ColocatedClient` (N colocated engines) and
`router.disagg_client.DisaggregatedClient` (P and D replicas, KV pushed between them).
A router replica makes one without engines and feeds it the engine controller's Membership
(`update`, again on every change); tests and benchmarks `start` one with engines of its own
and `wait_ready`. The router then calls `generate` for every engine request it makes (n > 1
makes n of them), `abort` when the client goes away, and `loads` to route and to export
per-replica metrics.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from ray.exceptions import RayActorError

from pd_cluster.config import EngineConfig
from pd_cluster.outputs import RequestOutput
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from router.app_config import AppConfig
from router.control.membership import Membership, ReplicaTable
from router.routing import ReplicaLoad, Route


class EngineClient(Protocol):
    @classmethod
    def start(cls, config: AppConfig, engine: EngineConfig,
              actor_options: Mapping[Role, dict[str, Any]]) -> EngineClient:
        """A client with engine replicas of its own (an unsupervised EngineFleet, its actors
        owned by the caller, `actor_options[role]` each); returns without waiting for them."""

    async def wait_ready(self, timeout_s: float) -> None:
        """Bring the client's own engines up: every replica loaded and joined; TimeoutError
        after `timeout_s`."""

    def update(self, membership: Membership) -> None:
        """Route over this membership's READY replicas from now on (older ones are ignored)."""

    def available(self) -> set[tuple[Role, int]]:
        """(role, replica id) of the replicas new requests may go to."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 route: Route) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative text and tokens, plus delta_text) until
        one is finished. Raises ValueError (a subclass) when the engine refuses the request.
        Closing the iterator early aborts the request and frees its KV on every replica."""

    async def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; unknown or finished ids are ignored."""

    async def loads(self, cursors: Mapping[tuple[Role, int], int] | None = None
                    ) -> list[ReplicaLoad]:
        """One fresh report per replica (prefill and decode): `actor.load(prefix_since=
        cursors.get((role, replica_id)))`, so a replica the cursors name (the routing policy's
        `prefix_cursors()`) adds its prefix cache's changes after that cursor (a
        PrefixReport), and the others, or all without `cursors`, none."""


LOAD_TIMEOUT_S = 5.0


async def answer_within(awaitable: Any, timeout_s: float) -> Any:
    """The answer of `awaitable` (an actor call) within `timeout_s`, else TimeoutError; the
    call is cancelled if we stop waiting. For loops that run until cancelled (lease renewals,
    latency reports): asyncio.wait_for before Python 3.12 returns the answer instead of
    raising CancelledError when the cancel lands as the answer arrives, and such a loop then
    outlives its cancellation (asyncio.run waits for it forever at exit)."""
    call = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout_s)
    finally:
        if not call.done():
            call.cancel()
    if not done:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return call.result()


async def table_loads(table: ReplicaTable, cursors: Mapping[tuple[Role, int], int] | None
                      ) -> list[ReplicaLoad]:
    """One fresh report per usable replica of `table` (a replica that turns out dead is
    marked so; one that does not answer within LOAD_TIMEOUT_S is left out this time)."""
    keyed = table.keyed()

    async def one(key: tuple[Role, int], actor: Any) -> Any:
        ref = (actor.load.remote() if cursors is None
               else actor.load.remote(prefix_since=cursors.get(key)))
        return await asyncio.wait_for(ref, LOAD_TIMEOUT_S)
    done = await asyncio.gather(*[one(k, a) for k, a in keyed], return_exceptions=True)
    for (key, _), d in zip(keyed, done):
        if isinstance(d, RayActorError):
            table.mark_dead(key)
    return [d for d in done if isinstance(d, ReplicaLoad)]
