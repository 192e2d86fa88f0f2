"""DisaggregatedClient: the router's EngineClient over prefill and decode actors.

How the prompt's KV gets from P to D is the deployment's KVHandoff (actors/handoff.py),
chosen once from the mode: PushHandoff (`disaggregated`) or PoolHandoff (`pooled`, through the
KV pool). At start, once every replica is up, the client connects it (P–D channels, or the
KV pool) and opens it on every replica. One request:
    1. D.reserve      blocks for the prompt on the decode replica the route names
    2. P.prefill      the prefill replica computes the prompt and hands its KV over (push:
                      layer by layer into D's blocks, while D still reserves); the first token
                      it answers goes to the caller at once
    3. D.decode       D obtains the KV (push: waits for the writes to land; pool: reads the
                      blocks it lacks), then streams the tokens after the first
The first token travels to the caller once: with stop strings (D judges its text with the
next) the router holds P's back and D's stream carries it (actors/messages.py, "The first
token's one trip").
What the handoff leaves outside the engines (the pool's hold on a prompt's blocks) the client
releases when the attempt ends early (abort, a dead D); else it expires in the pool.
Failures, by where they happen:
    - no room on D at reserve        → D prefills it itself (it queues there)
    - P died, or its handover failed → `prefill_failure_policy`: recompute (another live P,
                                       else D itself) or fail
    - D died mid-stream              → re-run on another live D from prompt + tokens already
                                       streamed; the caller sees one continuous stream
    - no live D left                 → EngineUnavailable
Closing the stream early aborts the request on P and D. Every engine the client uses holds
its subscriber lease (renewed by OutputStreams): if this router replica dies, the engines end
its requests themselves.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from actors.handoff import KVHandoff, PushHandoff
from actors.pool_client import PoolLost
from actors.messages import StreamAccumulator, StreamDelta
from pd_cluster.config import EngineConfig
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams
from router.app_config import AppConfig
from router.control.fleet import EngineFleet
from router.control.membership import Membership, ReplicaTable
from router.engine_client import table_loads
from router.errors import EngineUnavailable
from router.output_streams import OutputStreams
from router.routing import DECODE, PREFILL, ReplicaLoad, Route

log = logging.getLogger(__name__)
# D's reservations last lease_s (60 s by default); renew them well within that.
RENEW_EVERY_S = 5.0


class DisaggregatedClient:
    """See the module docstring. Its replicas come from a Membership (`update`): the engine
    controller's, in a router replica; a fleet of its own (`start`, `over`) in tests and
    benchmarks, brought up by `wait_ready`."""

    def __init__(self, recompute: bool = True, timeout_s: float = 120.0,
                 fleet: EngineFleet | None = None):
        self.recompute, self.timeout_s, self.fleet = recompute, timeout_s, fleet
        self.table = ReplicaTable()
        self.handoff: KVHandoff | None = None
        self.streams = OutputStreams()       # D's outputs, one Ray stream per D
        self._tasks: set[asyncio.Task] = set()
        self._where: dict[str, tuple[str, Any, Any]] = {}  # id → (attempt id, P or None, D)
        # (attempt id, generate called, P's first token back) of recent requests, monotonic:
        # with P's own stage stamps they say where a TTFT goes (pd_cluster/benchmark/
        # diagnostics.py).
        self.stamps: collections.deque = collections.deque(maxlen=4096)

    def __getstate__(self) -> dict:
        # A copy (benchmarks borrow the router's client) leaves our background tasks here.
        return {**self.__dict__, "_tasks": set(), "fleet": None}

    @property
    def prefill(self) -> list[Any]:
        """The prefill replicas' actors, by replica id (tests, benchmarks)."""
        return self.table.by_id(PREFILL)

    @property
    def decode(self) -> list[Any]:
        """The decode replicas' actors, by replica id (tests, benchmarks)."""
        return self.table.by_id(DECODE)

    @classmethod
    def start(cls, config: AppConfig, engine: EngineConfig,
              actor_options: Mapping[str, dict[str, Any]]) -> "DisaggregatedClient":
        """A client over engines of its own (an unsupervised fleet), brought up by
        wait_ready: tests and benchmarks without Serve."""
        fleet = EngineFleet.for_app(config, engine, actor_options, supervise=False)
        return cls(config.prefill_failure_policy == "recompute",
                   float(config.limits.request_timeout_s), fleet)

    @classmethod
    def over(cls, prefill: Sequence[Any], decode: Sequence[Any], recompute: bool = True,
             handoff: KVHandoff | None = None, timeout_s: float = 120.0,
             mode: str = "disaggregated") -> "DisaggregatedClient":
        """A client over actors the caller started (tests)."""
        fleet = EngineFleet.adopt(mode, prefill, decode, handoff or PushHandoff())
        return cls(recompute, timeout_s, fleet)

    async def wait_ready(self, timeout_s: float) -> None:
        """Bring this client's own fleet up: every replica loaded and joined to the KV
        handoff (push: every P–D pair connected both ways; pool: every replica to the KV
        pool), and D's output streams subscribed."""
        self.update(await self.fleet.wait_serving(timeout_s))
        await asyncio.gather(*[self.streams.subscribe(key, d, timeout_s)
                               for key, d in self.table.keyed() if key[0] == DECODE])

    def update(self, membership: Membership) -> None:
        """Route over this membership's replicas from now on."""
        if self.table.update(membership):
            self.handoff = membership.handoff

    @property
    def dead(self) -> set[tuple[str, int]]:
        """Replicas this client found dead and the membership has not replaced yet."""
        return self.table.dead

    def available(self) -> set[tuple[str, int]]:
        return self.table.available()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, route: Route) -> AsyncIterator[RequestOutput]:
        acc = StreamAccumulator(request_id, prompt_token_ids)
        attempt, d_id, entered = 0, route.decode_id, time.monotonic()
        try:
            while True:
                attempt_id = request_id if attempt == 0 else f"{request_id}#{attempt}"
                done = len(acc.token_ids)
                left = dataclasses.replace(params, max_tokens=params.max_tokens - done,
                                           min_tokens=max(0, params.min_tokens - done))
                if params.grammar is not None:   # its matcher replays what was streamed
                    left.grammar = params.grammar.continued(acc.token_ids)
                try:
                    await self.streams.open(attempt_id, (DECODE, d_id), self.table.actors[DECODE][d_id])
                    early = await self._start(request_id, attempt_id,
                                              prompt_token_ids + acc.token_ids, left,
                                              Route(d_id, route.prefill_id))
                    if early is not None:
                        self.stamps.append((attempt_id, entered, time.monotonic()))
                        yield acc.add(early)
                    async for delta in self.streams.deltas(attempt_id, self.timeout_s):
                        yield acc.add(delta)
                    return
                except RayActorError as e:
                    self.handoff.release(attempt_id)
                    self.table.mark_dead((DECODE, d_id))
                    d_id = self._live(DECODE, exclude=d_id, cause=e)
                    attempt += 1
                    log.warning("decode replica died; re-running %s on decode %d from %d "
                                "streamed tokens", request_id, d_id, len(acc.token_ids))
                finally:
                    self.streams.close(attempt_id)
        finally:
            where = self._where.pop(request_id, None)
            if where is not None:
                self._abort_quietly(*where)

    async def _start(self, request_id: str, attempt_id: str, prompt: list[int],
                     params: SamplingParams, route: Route) -> StreamDelta | None:
        """Start one try on one decode replica (its outputs come through self.streams);
        returns the first token's delta when the prefill side already has it (TTFT does
        not wait for D; D's stream starts after it). Raises RayActorError if that replica
        dies."""
        d = self.table.actors[DECODE][route.decode_id]
        self._where[request_id] = (attempt_id, None, d)
        if route.prefill_id is not None:
            # Reserve on D and prefill on P at once: P needs D's blocks only for its first
            # writes (pool: not at all), so the reservation's round trip stays off the TTFT path.
            reservation = d.reserve.remote(attempt_id, prompt, params, self.streams.sub)
            result = await self._prefill(request_id, attempt_id, prompt, params,
                                         self.handoff.destination(reservation),
                                         route.prefill_id, d)
            self._where[request_id] = (attempt_id, None, d)
            if result is not None:   # None from accept: D had no room, it prefills below
                accepted = await self.handoff.accept(attempt_id, result, reservation)
                if accepted is None:   # (pool: or the KV pool lost the prompt's blocks)
                    await d.abort.remote(attempt_id)   # its reservation, if it made one
                result = accepted
            if result is not None:
                # With stop strings, D must judge the first token's text with the next.
                early = None if params.stop else result.first
                # Not awaited here: the early token goes out while D waits for the KV; a
                # failure to take it over surfaces through the request's stream.
                self._resume(attempt_id, d, result, prompt, params, early is not None)
                return early
        # D prefills it itself: by the route, for lack of room, or as the fallback.
        await d.generate.remote(attempt_id, prompt, params, self.streams.sub)
        return None

    def _resume(self, attempt_id: str, d: Any, result: Any, prompt: list[int],
                params: SamplingParams, first_sent: bool) -> None:
        """D.decode in the background; its error (KV not landed, D died) ends the stream,
        except that a live D whose KV did not land (a failed read from the KV pool)
        prefills the prompt itself under the recompute policy, or whatever the policy when
        the KV pool died. `first_sent`: the caller has P's first token, so D's stream starts
        after it, even when D prefills."""
        async def run() -> None:
            try:
                try:
                    await d.decode.remote(attempt_id, result, self.streams.sub, first_sent)
                except RayTaskError as e:
                    if not (self.recompute or isinstance(e.cause, PoolLost)):
                        raise
                    log.warning("%s: the KV did not land on decode (%s); it prefills itself",
                                attempt_id, _reason(e))
                    await d.abort.remote(attempt_id)   # done with the id before its reuse
                    await d.generate.remote(attempt_id, prompt, params, self.streams.sub,
                                            first_sent)
            except Exception as e:  # noqa: BLE001 - handed to the request's reader
                self.streams.fail(attempt_id, e)
        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefill(self, request_id: str, attempt_id: str, prompt: list[int],
                       params: SamplingParams, destination: list | None, p_id: int, d: Any):
        """The PrefillResult, or None when D should prefill itself (recompute policy).
        `destination`: the handoff's, for P."""
        tried: set[int] = set()
        while True:
            p = self.table.actors[PREFILL][p_id]
            self._where[request_id] = (attempt_id, p, d)
            self.streams.lease((PREFILL, p_id), p)
            try:
                return await _renewing(d, attempt_id, p.prefill.remote(
                    attempt_id, prompt, params, destination, self.streams.sub))
            except (RayActorError, RayTaskError) as e:
                if isinstance(e, RayActorError):
                    self.table.mark_dead((PREFILL, p_id))
                if not self.recompute:
                    await d.abort.remote(attempt_id)
                    raise EngineUnavailable(f"prefill failed and prefill_failure_policy is "
                                            f"'fail': {_reason(e)}") from e
                tried.add(p_id)
                log.warning("prefill of %s failed on prefill %d (%s)", request_id, p_id,
                            _reason(e))
                if isinstance(e, RayTaskError):
                    # The handover failed (or D had no room) but P lives: D's reserved blocks
                    # may be half written, so D recomputes the prompt itself.
                    await d.abort.remote(attempt_id)
                    return None
                alive = [i for i in self.table.live(PREFILL) if i not in tried]
                if not alive:
                    await d.abort.remote(attempt_id)
                    return None
                p_id = alive[0]

    def _live(self, role: str, exclude: int, cause: Exception) -> int:
        alive = self.table.live(role, exclude)
        if not alive:
            raise EngineUnavailable(f"no live {role} replica left to continue the request "
                                    f"({_reason(cause)})") from cause
        return alive[0]

    def _abort_quietly(self, attempt_id: str, p: Any, d: Any) -> None:
        # Fire and forget: this may run while the caller is being cancelled.
        for actor in (p, d):
            if actor is not None:
                actor.abort.remote(attempt_id)
        self.handoff.release(attempt_id)

    async def abort(self, request_id: str) -> None:
        where = self._where.get(request_id)
        if where is not None:
            self._abort_quietly(*where)

    async def loads(self, cursors: Mapping[tuple[str, int], int] | None = None
                    ) -> list[ReplicaLoad]:
        return await table_loads(self.table, cursors)


async def _renewing(d: Any, request_id: str, prefill: Any) -> Any:
    """Await the prefill while renewing D's lease on the reserved blocks."""
    task = asyncio.ensure_future(prefill)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=RENEW_EVERY_S)
            if done:
                return task.result()
            d.renew.remote(request_id)
    finally:
        if not task.done():
            task.cancel()


def _reason(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
