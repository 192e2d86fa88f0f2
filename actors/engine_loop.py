"""EngineLoop: one LLMEngine stepped by a background thread, streamed to asyncio consumers.

Lifecycle of a request:
    stream(id, ids, params)  → a per-request asyncio queue is registered and an ADD command
                               is queued for the engine thread (the event loop never blocks)
    engine thread            → applies queued commands, then `engine.step()` while requests
                               exist; each RequestOutput goes to its request's queue through
                               `loop.call_soon_threadsafe`; sleeps on an event when idle
    consumer                 → iterates outputs until one is finished; if it stops early
                               (break, GeneratorExit, CancelledError, stall timeout), the
                               request is aborted in the engine, which frees its KV blocks
    submit(id, ids, params, q) → the same, but the outputs go to a shared queue `q` as
                               (id, output) items (an Outbox's: one Ray stream per router
                               replica); only `abort(id)` stops such a request early
The engine is touched only by its thread, so it needs no lock; `load()` reads a snapshot
(a ReplicaLoad, in the name of the replica the loop was made for) that the thread refreshes
after every step. The thread also publishes the prefix cache's events after every step (one
lock per step, pd_cluster/block_allocator.py: PrefixEventLog); `load(prefix_since)` adds
what changed after that cursor (a PrefixReport) for routers.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from actors.messages import PrefixReport, ReplicaLoad
from pd_cluster.config import EngineConfig
from pd_cluster.engine import LLMEngine
from pd_cluster.models.loader import model_loads
from pd_cluster.outputs import RequestOutput
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps before re-checking for shutdown.
IDLE_WAIT_S = 0.5
# A failed step of a tensor-parallel engine waits this long for a dead rank to show.
RANK_DEATH_SEEN_S = 2.0
# The engine thread shares the GIL with the actor's event loop (outputs, Ray streams). Each
# step it lets go of the GIL while the GPU works; taking it back, it waits until the loop's
# thread lets go, which a thread busy in Python does only every switch interval (5 ms by
# default): up to 5 ms added to a 10-15 ms decode step. A shorter interval bounds that wait.
# PD_ENGINE_SWITCH_INTERVAL_S overrides it (benchmarks compare the two).
SWITCH_INTERVAL_S = float(os.environ.get("PD_ENGINE_SWITCH_INTERVAL_S", "0.0005"))


class RequestRejected(ValueError):
    """The engine refused a request (too long, too large for the KV cache, duplicate id)."""


class EngineFailed(RuntimeError):
    """A step of the engine raised; every request that was in it is failed with this."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    hold_kv: bool = False
    # When it was queued (monotonic): its wait for the step in progress is the engine's time.
    queued: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Resume:
    """Decode side: a reserved request's KV has landed; continue from its first token."""

    request_id: str
    token: int
    logprobs: dict[int, float] | None


@dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread; its result goes to `future` on `loop`."""

    fn: Any
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Sink:
    """Where a request's outputs go: an asyncio queue owned by the consumer's event loop.
    Tagged sinks share a queue (an Outbox's) and put (tag, output) items; the engine thread
    closes them after the finished output or an error."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tag: str | None = None


class EngineLoop:
    """Owns an LLMEngine and runs it on a background thread; see the module docstring."""

    def __init__(self, config: EngineConfig, stall_timeout_s: float = 600.0,
                 role: Role = Role.DECODE, replica_id: int = 0) -> None:
        self.engine = LLMEngine(config)
        sys.setswitchinterval(SWITCH_INTERVAL_S)        # process-wide: this is the engine's
        self.role = Role.parse(role)                    # whose load() reports it is
        self.replica_id = replica_id
        self.stall_timeout_s = stall_timeout_s   # longest wait for a request's next output
        self._commands: collections.deque[_Add | _Abort | _Resume | _Call] = collections.deque()
        # Watches every step (the prefill side's KV pusher); set before requests arrive.
        self.listener = None
        self._sinks: dict[str, _Sink] = {}
        self._wake = threading.Event()
        self._stopped = False
        # Before the thread starts: from here on only it touches the allocator.
        self.prefix_events = self.engine.kv.allocator.record_events()
        self._load = self._snapshot()
        # Diagnostics: (began, ended, waiting, running) of recent steps, monotonic seconds;
        # idle gaps between steps while requests waited show up here, not in step durations.
        self.step_log: collections.deque = collections.deque(maxlen=4096)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     hold_kv: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; raises RequestRejected, EngineFailed or
        TimeoutError. Stopping the iteration early aborts the request. `hold_kv`: see
        `LLMEngine.add_request` (the prefill side of disaggregation)."""
        async for out in self._consume(request_id,
                                       _Add(request_id, list(prompt_ids), params, hold_kv)):
            yield out

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               queue: asyncio.Queue) -> None:
        """Like `stream`, but the outputs go to `queue` (anything with put_nowait, e.g. an
        Outbox mailbox) as (request_id, output) items, and an error as (request_id,
        exception); nothing aborts the request unless `abort` is called."""
        self._open(request_id, queue, _Add(request_id, list(prompt_ids), params))

    def resume_into(self, request_id: str, token: int, logprobs: dict[int, float] | None,
                    queue: asyncio.Queue) -> None:
        """Continue a request reserved with `call(engine.reserve)` whose KV has arrived, from
        its first token; outputs into `queue` as `submit` does."""
        self._open(request_id, queue, _Resume(request_id, token, logprobs))

    def _open(self, request_id: str, queue: asyncio.Queue, start: _Add | _Resume) -> None:
        if request_id in self._sinks:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self._sinks[request_id] = _Sink(asyncio.get_running_loop(), queue, request_id)
        self._submit(start)

    async def call(self, fn: Any, timeout_s: float = 60.0) -> Any:
        """`fn(engine)` on the engine thread, between steps; returns its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(_Call(fn, loop, future))
        return await asyncio.wait_for(future, timeout_s)

    async def _consume(self, request_id: str, start: _Add) -> AsyncIterator[RequestOutput]:
        if request_id in self._sinks:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        sink = _Sink(asyncio.get_running_loop())
        self._sinks[request_id] = sink
        self._submit(start)
        finished, held = False, None
        try:
            while not finished:
                item, held = held, None
                if item is None:
                    item = await asyncio.wait_for(sink.queue.get(), self.stall_timeout_s)
                if isinstance(item, Exception):
                    finished = True      # the engine has already dropped the request
                    raise item
                item, held = _coalesce(item, sink.queue)
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            self._sinks.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with a finished output (finish_reason "abort")."""
        self._submit(_Abort(request_id))

    def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """Running and waiting requests, KV blocks, prefix-cache counters (a recent snapshot);
        with `prefix_since` (a cursor, -1 for none) also the prefix cache's changes after it
        (`prefix`, a PrefixReport), else no prefix report (the cheap call)."""
        if prefix_since is None:
            return self._load
        log = self.prefix_events
        return dataclasses.replace(self._load,
                                   prefix=PrefixReport(log.epoch, *log.changes(prefix_since)))

    def shutdown(self) -> None:
        """Stop the engine thread (within a step plus IDLE_WAIT_S); pending requests fail."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=60)
        self.engine.close()

    def _submit(self, command: _Add | _Abort | _Resume | _Call) -> None:
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()   # before draining, so a command queued after it wakes us
            self._apply_commands()
            if not self.engine.has_unfinished():
                self.refresh()
                self._wake.wait(IDLE_WAIT_S)
                continue
            try:
                began, sched = time.monotonic(), self.engine.scheduler
                waiting, running = len(sched.waiting), len(sched.running)
                outputs = self.engine.step(self.listener)
                self.step_log.append((began, time.monotonic(), waiting, running))
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the thread
                logger.exception("engine step failed")
                self._exit_if_ranks_died()     # before failing its requests: they migrate
                self._fail_all(EngineFailed(f"engine step failed: {e!r}"))
                continue
            self._deliver_step(outputs)
            self.refresh()
        self._fail_all(EngineFailed("engine loop shut down"))

    def _exit_if_ranks_died(self) -> None:
        """A tensor-parallel rank died: this engine can never step again. End the process,
        so that its replica is seen dead at once (its requests migrate, the controller
        restarts it) rather than failing every request it is given."""
        if self.engine.config.tensor_parallel_size == 1:
            return
        # The broken collective may come a moment before the dead rank's exit is seen.
        deadline = time.monotonic() + RANK_DEATH_SEEN_S
        while not (dead := self.engine.dead_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            logger.error("tensor-parallel rank(s) %s of this engine died; exiting so that the "
                         "replica is replaced", dead)
            logging.shutdown()
            os._exit(1)

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                self._apply(command)
            except Exception as e:  # noqa: BLE001 - one bad command must not kill the thread
                logger.exception("engine command failed")
                rid = getattr(command, "request_id", None)
                if rid is not None:
                    self._deliver(rid, EngineFailed(f"engine command failed: {e!r}"))

    def _apply(self, command: _Add | _Abort | _Resume | _Call) -> None:
        if isinstance(command, _Abort):
            out = self.engine.abort(command.request_id)
            if out is not None:
                self._deliver(command.request_id, out)
            elif getattr(self._sinks.get(command.request_id), "tag", None) is not None:
                del self._sinks[command.request_id]   # nothing left to say: close it
        elif isinstance(command, _Call):
            self._run_call(command)
        elif isinstance(command, _Resume):
            self._resume(command)
        elif command.request_id in self._sinks:   # else its consumer left before we saw it
            try:
                self.engine.add_request(command.prompt_ids, command.params, command.request_id,
                                        hold_kv=command.hold_kv, arrival_time=command.queued)
            except ValueError as e:
                self._deliver(command.request_id, RequestRejected(str(e)))

    def _resume(self, command: _Resume) -> None:
        if command.request_id not in self.engine.scheduler.parked:
            self._deliver(command.request_id, RequestRejected(
                f"request {command.request_id!r} holds no KV reservation here (expired?)"))
            return
        out = self.engine.resume(command.request_id, command.token, command.logprobs)
        self._deliver(command.request_id, out)

    def _run_call(self, command: _Call) -> None:
        try:
            result, error = command.fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            result, error = None, e

        def settle() -> None:
            if command.future.done():  # the caller timed out meanwhile
                return
            if error is None:
                command.future.set_result(result)
            else:
                command.future.set_exception(error)
        try:
            command.loop.call_soon_threadsafe(settle)
        except RuntimeError:      # the caller's event loop is closed
            pass

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)
        for request_id in list(self._sinks):
            self._deliver(request_id, error)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per consumer event loop per step, not one per output: at batch 256 the
        per-call cost of waking the loop would rival the step itself."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is not None:
                by_loop.setdefault(sink.loop, []).append((sink.queue, self._item(sink, out)))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumer's event loop is closed: nobody to tell
                pass

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, self._item(sink, item))
        except RuntimeError:      # the consumer's event loop is closed: nobody to tell
            pass

    def _item(self, sink: _Sink, item: RequestOutput | Exception) -> Any:
        """What goes on the sink's queue; a tagged sink closes with its last item."""
        if sink.tag is None:
            return item
        if isinstance(item, Exception) or item.finished:
            self._sinks.pop(sink.tag, None)
        return sink.tag, item

    def refresh(self) -> None:
        """After each step and command batch: what the step cached and evicted, then the load
        (engine thread)."""
        self.prefix_events.publish()
        self._load = self._snapshot()

    def _snapshot(self) -> ReplicaLoad:
        sched, kv = self.engine.scheduler, self.engine.kv
        return ReplicaLoad(
            self.role, self.replica_id, num_running=len(sched.running),
            num_waiting=len(sched.waiting), kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks, kv_blocks_cached=kv.allocator.num_cached_blocks,
            model_loads=model_loads(), prefix_queries=sched.stats.prefix_queries,
            prefix_hits=sched.stats.prefix_hits, num_preemptions=sched.stats.num_preemptions,
            steps={kind: t.as_dict() for kind, t in self.engine.step_totals.items()},
            spec_decode=self.engine.spec.stats.as_dict() if self.engine.spec else {})


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _coalesce(item: RequestOutput, queue: asyncio.Queue
              ) -> tuple[RequestOutput, Exception | None]:
    """Fold outputs that queued up behind `item` into one (the consumer fell behind): the
    latest cumulative state, with the deltas of all of them. Returns it and an error that
    was queued after them, if any (to raise once they are out)."""
    delta_text, delta_ids = item.delta_text, list(item.delta_token_ids)
    folded = item
    while not folded.finished and not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, Exception):
            return _with_deltas(folded, item, delta_text, delta_ids), nxt
        delta_text += nxt.delta_text
        delta_ids += nxt.delta_token_ids
        folded = nxt
    return _with_deltas(folded, item, delta_text, delta_ids), None


def _with_deltas(folded: RequestOutput, first: RequestOutput, text: str,
                 ids: list[int]) -> RequestOutput:
    if folded is first:
        return first
    return dataclasses.replace(folded, delta_text=text, delta_token_ids=ids)
