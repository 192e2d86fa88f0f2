"""DisaggregatedClient: the router's EngineClient over prefill (P) and decode (D) engine actors.

The P/D protocol, one attempt at a request as this client drives it (its stages: router/
disagg_attempt.py; P's and D's sides: actors/prefill_side.py, actors/decode_side.py; how the
KV moves: the deployment's KVHandoff, actors/handoff.py):

  stage          router                             P                        D
  PREFILLING     D.reserve(id, prompt) ─────────────────────────────────────► blocks reserved
                 P.prefill(id, prompt, destination) ─► computes the prompt,
                 (renewing D's reservation meanwhile)   hands its KV over
                                                        (push: layer by layer
                                                        into D's blocks; pool:
                                                        into the KV pool)
                 ◄──────────────────────────────────── PrefillResult: the
                                                        first token, where
                                                        the KV is
  HANDED_OFF     the first token to the caller, then
                 D.decode(id, result, first_sent) ──────────────────────────► takes the KV over,
                                                                             resumes from the
                                                                             first token
  DECODING       ◄───────────────────────────────────────────────────────── its stream: the
                 the caller's                                                tokens after the
  FINISHED                                                                   first

The first token travels to the caller once: in P's result, as soon as P has it, and D's
stream starts after it. With stop strings (D judges the first token's text with the next)
the router holds P's back and D's stream carries it instead (`first_sent` False; actors/
messages.py, "The first token's one trip").

The handoff is chosen once from the mode: PushHandoff (`disaggregated`) or PoolHandoff
(`pooled`). At start, once every replica is up, the client connects it (P–D channels, or the
KV pool) and opens it on every replica. What it leaves outside the engines (the pool's hold
on a prompt's blocks) the client releases when an attempt ends early (aborted, failed, or D
died); else it expires in the pool.
Failures, by where they happen:
    - no room on D at reserve        → LOCAL_PREFILL: D prefills it itself (it queues there)
    - P died                         → PREFILLING again on another live P (recompute policy)
    - P's handover failed, or no live P left
                                     → `prefill_failure_policy`: recompute (LOCAL_PREFILL) or
                                       fail (FAILED)
    - the KV did not land on D       → recompute (or the KV pool died, whatever the policy):
                                       LOCAL_PREFILL; else FAILED
    - D died                         → MIGRATED: a new attempt on another live D from prompt +
                                       tokens already streamed; the caller sees one stream
    - D died, the request already moved `max_migrations` times
                                     → FAILED: EngineUnavailable (a request that kills
                                       every D it lands on must not take the tier down)
    - no live D left                 → FAILED: EngineUnavailable
Closing the stream early aborts the request on P and D (ABORTED). Every engine the client
uses holds its subscriber lease (renewed by OutputStreams): if this router replica dies, the
engines end its requests themselves.
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

from actors.engine_actor import RESERVATION_RENEW_EVERY_S
from actors.handoff import KVHandoff, PushHandoff
from actors.messages import PrefillResult, StreamAccumulator, StreamDelta
from actors.pool_client import PoolLost
from pd_cluster.config import EngineConfig
from pd_cluster.outputs import RequestOutput
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from router.app_config import AppConfig
from router.control.fleet import EngineFleet
from router.control.membership import Membership, ReplicaTable
from router.disagg_attempt import Attempt, Stage
from router.engine_client import table_loads
from router.errors import EngineUnavailable
from router.output_streams import OutputStreams
from router.routing import ReplicaLoad, Route
from router.tracing import CURRENT
from router.transfer_metrics import TransferMetrics

log = logging.getLogger(__name__)


class DisaggregatedClient:
    """See the module docstring. Its replicas come from a Membership (`update`): the engine
    controller's, in a router replica; a fleet of its own (`start`, `over`) in tests and
    benchmarks, brought up by `wait_ready`."""

    def __init__(self, recompute: bool = True, timeout_s: float = 120.0,
                 fleet: EngineFleet | None = None, max_migrations: int = 3):
        self.recompute, self.timeout_s, self.fleet = recompute, timeout_s, fleet
        self.max_migrations = max_migrations
        self.table = ReplicaTable()
        self.handoff: KVHandoff | None = None
        self.streams = OutputStreams()       # D's outputs, one Ray stream per D
        self._attempts: dict[str, Attempt] = {}    # request id → its current attempt
        self._pending: set[asyncio.Future] = set()  # D.decode replies nobody awaits any more
        # (attempt id, generate called, P's first token back) of recent requests, monotonic:
        # with P's own stage stamps they say where a TTFT goes (bench/harness/diagnostics.py).
        self.stamps: collections.deque = collections.deque(maxlen=4096)
        # Per-transfer metrics (router/transfer_metrics.py), set by the router replica.
        self.transfers: TransferMetrics | None = None
        self.transport = ""

    def __getstate__(self) -> dict:
        # A copy (benchmarks borrow the router's client) leaves our requests here, and the
        # router's metrics (a registry does not travel).
        return {**self.__dict__, "_attempts": {}, "_pending": set(), "fleet": None,
                "transfers": None}

    @property
    def prefill(self) -> list[Any]:
        """The prefill replicas' actors, by replica id (tests, benchmarks)."""
        return self.table.by_id(Role.PREFILL)

    @property
    def decode(self) -> list[Any]:
        """The decode replicas' actors, by replica id (tests, benchmarks)."""
        return self.table.by_id(Role.DECODE)

    @classmethod
    def start(cls, config: AppConfig, engine: EngineConfig,
              actor_options: Mapping[Role, dict[str, Any]]) -> DisaggregatedClient:
        """A client over engines of its own (an unsupervised fleet), brought up by
        wait_ready: tests and benchmarks without Serve."""
        fleet = EngineFleet.for_app(config, engine, actor_options, supervise=False)
        return cls(config.prefill_failure_policy == "recompute",
                   float(config.limits.request_timeout_s), fleet, config.limits.max_migrations)

    @classmethod
    def over(cls, prefill: Sequence[Any], decode: Sequence[Any], recompute: bool = True,
             handoff: KVHandoff | None = None, timeout_s: float = 120.0,
             mode: str = "disaggregated", max_migrations: int = 3) -> DisaggregatedClient:
        """A client over actors the caller started (tests)."""
        fleet = EngineFleet.adopt(mode, prefill, decode, handoff or PushHandoff())
        return cls(recompute, timeout_s, fleet, max_migrations)

    async def wait_ready(self, timeout_s: float) -> None:
        """Bring this client's own fleet up: every replica loaded and joined to the KV
        handoff (push: every P–D pair connected both ways; pool: every replica to the KV
        pool), and D's output streams subscribed."""
        self.update(await self.fleet.wait_serving(timeout_s))
        await asyncio.gather(*[self.streams.subscribe(key, d, timeout_s)
                               for key, d in self.table.keyed() if key[0] == Role.DECODE])

    def update(self, membership: Membership) -> None:
        """Route over this membership's replicas from now on."""
        if self.table.update(membership):
            self.handoff = membership.handoff

    @property
    def dead(self) -> set[tuple[Role, int]]:
        """Replicas this client found dead and the membership has not replaced yet."""
        return self.table.dead

    def available(self) -> set[tuple[Role, int]]:
        return self.table.available()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, route: Route) -> AsyncIterator[RequestOutput]:
        acc = StreamAccumulator(request_id, prompt_token_ids)
        number, d_id, entered = 0, route.decode_id, time.monotonic()
        trace = CURRENT.get()     # the request's trace (router/tracing.py); None: untraced
        job = None if trace is None else trace.job(request_id)
        try:
            while True:
                attempt = Attempt.start(request_id, number, d_id,
                                        self.table.actors[Role.DECODE][d_id], route.prefill_id)
                attempt.trace = job
                if job is not None:
                    job.dispatching(time.monotonic())
                self._attempts[request_id] = attempt
                prompt, left = prompt_token_ids + acc.token_ids, _rest(params, acc.token_ids)
                try:
                    await self.streams.open(attempt.id, (Role.DECODE, d_id), attempt.d)
                    first, decoding = await self._start(attempt, prompt, left)
                    if first is not None:
                        self.stamps.append((attempt.id, entered, time.monotonic()))
                        yield acc.add(first)
                    if decoding is not None:
                        await self._take_over(attempt, decoding, prompt, left)
                    deltas = self.streams.deltas(attempt.id, self.timeout_s)
                    if job is not None:     # (untraced: no per-token work for tracing)
                        deltas = job.watch(deltas, d_id)
                    async for delta in deltas:
                        yield acc.add(delta)
                    attempt.move_to(Stage.FINISHED)
                    return
                except RayActorError as e:   # D died
                    died_at = time.monotonic()
                    self.handoff.release(attempt.id)
                    self.table.mark_dead((Role.DECODE, d_id))
                    try:
                        if number >= self.max_migrations:
                            raise EngineUnavailable(
                                f"request {request_id} lost its decode replica after "
                                f"{number} migration(s), the most limits.max_migrations "
                                f"allows ({self.max_migrations})") from e
                        d_id = self._live(Role.DECODE, exclude=d_id, cause=e)
                    except EngineUnavailable:
                        attempt.move_to(Stage.FAILED)
                        raise
                    attempt.move_to(Stage.MIGRATED)
                    if job is not None:
                        job.migrated(attempt.d_id, d_id, died_at, len(acc.token_ids))
                    number += 1
                    log.warning("decode replica died; re-running %s on decode %d from %d "
                                "streamed tokens", request_id, d_id, len(acc.token_ids))
                except BaseException as e:
                    gone = isinstance(e, (GeneratorExit, asyncio.CancelledError))
                    attempt.move_to(Stage.ABORTED if gone else Stage.FAILED)
                    self._abort_quietly(attempt)
                    raise
                finally:
                    self.streams.close(attempt.id)
        finally:
            self._attempts.pop(request_id, None)

    async def _start(self, attempt: Attempt, prompt: list[int], params: SamplingParams
                     ) -> tuple[StreamDelta | None, asyncio.Future | None]:
        """Start the attempt on its decode replica (its outputs come through self.streams).
        PREFILLING → HANDED_OFF: returns P's first token for the caller (None with stop
        strings) and D.decode's reply, to await (D takes the KV over meanwhile). Else →
        LOCAL_PREFILL → DECODING: D prefills the prompt itself; returns (None, None). Raises
        RayActorError if that replica dies."""
        d = attempt.d
        if attempt.stage is Stage.PREFILLING:
            # Reserve on D and prefill on P at once: P needs D's blocks only for its first
            # writes (pool: not at all), so the reservation's round trip stays off the TTFT path.
            reservation = d.reserve.remote(attempt.id, prompt, params, self.streams.sub)
            result = await self._prefill(attempt, prompt, params,
                                         self.handoff.destination(reservation))
            if result is not None:   # None from accept: D had no room, it prefills below
                accepted = await self.handoff.accept(attempt.id, result, reservation)
                if accepted is None:   # (pool: or the KV pool lost the prompt's blocks)
                    await d.abort.remote(attempt.id)   # its reservation, if it made one
                result = accepted
            if result is not None:
                # With stop strings, D must judge the first token's text with the next.
                attempt.first_sent = not params.stop
                attempt.move_to(Stage.HANDED_OFF)
                # Not awaited here: the first token goes out while D waits for the KV.
                decoding = self._reply(d.decode.remote(attempt.id, result, self.streams.sub,
                                                       attempt.first_sent))
                return (result.first if attempt.first_sent else None), decoding
            attempt.move_to(Stage.LOCAL_PREFILL)
        await self._local_prefill(attempt, prompt, params)
        return None, None

    async def _take_over(self, attempt: Attempt, decoding: asyncio.Future, prompt: list[int],
                         params: SamplingParams) -> None:
        """HANDED_OFF → DECODING once D has the KV (`decoding`: D.decode's reply). If it did
        not land on a live D (a failed transfer, a failed read from the KV pool): →
        LOCAL_PREFILL under the recompute policy, or whatever the policy when the KV pool
        died; else its error goes to the caller."""
        try:
            times = await asyncio.wait_for(asyncio.shield(decoding), self.timeout_s)
        except RayTaskError as e:
            if self.transfers is not None:
                self.transfers.fail(self.transport, attempt.p_id, attempt.d_id, e)
            if not (self.recompute or isinstance(e.cause, PoolLost)):
                raise
            log.warning("%s: the KV did not land on decode (%s); it prefills itself",
                        attempt.id, _reason(e))
            attempt.move_to(Stage.LOCAL_PREFILL)
            await attempt.d.abort.remote(attempt.id)   # done with the id before its reuse
            await self._local_prefill(attempt, prompt, params)
            return
        except TimeoutError:
            raise TimeoutError(f"no output for {attempt.id} in {self.timeout_s:g} s") from None
        if attempt.trace is not None and times is not None:
            attempt.trace.landing(attempt.d_id, times)
        attempt.move_to(Stage.DECODING)

    async def _local_prefill(self, attempt: Attempt, prompt: list[int],
                             params: SamplingParams) -> None:
        """LOCAL_PREFILL → DECODING: D prefills the prompt itself (its stream after the first
        token when the caller has P's); returns once D has queued it."""
        await attempt.d.generate.remote(attempt.id, prompt, params, self.streams.sub,
                                        attempt.first_sent)
        attempt.move_to(Stage.DECODING)

    async def _prefill(self, attempt: Attempt, prompt: list[int], params: SamplingParams,
                       destination: list | None) -> PrefillResult | None:
        """P's result, or None when D should prefill the prompt itself (recompute policy).
        `destination`: the handoff's, for P."""
        d, tried = attempt.d, set()
        while True:
            p = attempt.p = self.table.actors[Role.PREFILL][attempt.p_id]
            self.streams.lease((Role.PREFILL, attempt.p_id), p)
            called = time.monotonic()
            try:
                result = await _renewing(d, attempt.id, p.prefill.remote(
                    attempt.id, prompt, params, destination, self.streams.sub))
                attempt.p = None
                self._transferred(attempt, called, result)
                return result
            except (RayActorError, RayTaskError) as e:
                self._transferred(attempt, called, None, e)
                if isinstance(e, RayActorError):
                    self.table.mark_dead((Role.PREFILL, attempt.p_id))
                if not self.recompute:
                    await d.abort.remote(attempt.id)
                    raise EngineUnavailable(f"prefill failed and prefill_failure_policy is "
                                            f"'fail': {_reason(e)}") from e
                tried.add(attempt.p_id)
                log.warning("prefill of %s failed on prefill %d (%s)", attempt.id,
                            attempt.p_id, _reason(e))
                # A failed handover (or D without room) on a live P: D's reserved blocks may be
                # half written, so D recomputes the prompt itself; so it does with no P left.
                alive = ([] if isinstance(e, RayTaskError) else
                         [i for i in self.table.live(Role.PREFILL) if i not in tried])
                if not alive:
                    attempt.p = None
                    await d.abort.remote(attempt.id)
                    return None
                attempt.p_id = alive[0]
                attempt.move_to(Stage.PREFILLING)

    def _transferred(self, attempt: Attempt, called: float, result: PrefillResult | None,
                     error: BaseException | None = None) -> None:
        """P's answer (or error) for the transfer metrics and the request's trace."""
        if self.transfers is not None:
            if error is not None:
                self.transfers.fail(self.transport, attempt.p_id, attempt.d_id, error)
            elif result.times is not None:   # (pooled: the handover into the KV pool)
                self.transfers.observe(self.transport, attempt.p_id, attempt.d_id,
                                       result.kv_bytes, result.transfer_s)
        if attempt.trace is not None:
            attempt.trace.prefill(attempt.p_id, attempt.d_id, called, time.monotonic(), result,
                                  error)

    def _reply(self, ref: Any) -> asyncio.Future:
        """An engine call's reply, kept until it comes even if the request goes away first
        (its error then counts as seen)."""
        reply = asyncio.ensure_future(ref)
        self._pending.add(reply)
        reply.add_done_callback(lambda f: self._pending.discard(f) or f.cancelled()
                                or f.exception())
        return reply

    def _live(self, role: Role, exclude: int, cause: Exception) -> int:
        alive = self.table.live(role, exclude)
        if not alive:
            raise EngineUnavailable(f"no live {role} replica left to continue the request "
                                    f"({_reason(cause)})") from cause
        return alive[0]

    def _abort_quietly(self, attempt: Attempt) -> None:
        # Fire and forget: this may run while the caller is being cancelled.
        for actor in (attempt.p, attempt.d):
            if actor is not None:
                actor.abort.remote(attempt.id)
        self.handoff.release(attempt.id)

    async def abort(self, request_id: str) -> None:
        attempt = self._attempts.get(request_id)
        if attempt is not None:
            self._abort_quietly(attempt)

    async def loads(self, cursors: Mapping[tuple[Role, int], int] | None = None
                    ) -> list[ReplicaLoad]:
        return await table_loads(self.table, cursors)


def _rest(params: SamplingParams, streamed: list[int]) -> SamplingParams:
    """What is left of `params` once `streamed` tokens are out (a re-run after D died)."""
    done = len(streamed)
    left = dataclasses.replace(params, max_tokens=params.max_tokens - done,
                               min_tokens=max(0, params.min_tokens - done))
    if params.grammar is not None:   # its matcher replays what was streamed
        left.grammar = params.grammar.continued(streamed)
    return left


async def _renewing(d: Any, request_id: str, prefill: Any) -> Any:
    """Await the prefill while renewing D's lease on the reserved blocks."""
    task = asyncio.ensure_future(prefill)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=RESERVATION_RENEW_EVERY_S)
            if done:
                return task.result()
            d.renew.remote(request_id)
    finally:
        if not task.done():
            task.cancel()


def _reason(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
