"""OutputStreams: this router replica's end of the engine actors' outboxes.

An engine actor sends all of a router replica's request outputs on one Ray stream
(`actor.outputs(sub)`, see actors/streaming.py) instead of one stream per request. Here one
background task per actor reads that stream and hands each (request id, delta) to the
request's own asyncio queue.

Lifecycle of a request:
    open(id, key, actor)  → its queue exists, and the actor's reader runs and has
                            subscribed (so no output of the request can be missed); our
                            subscriber lease on the actor is renewed in the background
                            (`lease`, also for actors we do not read: prefill engines)
    the caller starts the request on the actor (generate / decode)
    deltas(id, timeout)   → its StreamDeltas until the finished one; an engine error is
                            raised as RequestRejected / EngineFailed / TimeoutError; if the
                            actor's stream breaks (the actor died), the error that broke it
                            (RayActorError) is raised in every request reading from it
    close(id)             → always, at the end of the request or of one try of it
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Hashable
from typing import Any

from ray.exceptions import RayActorError

from actors.engine_loop import EngineFailed
from actors.messages import StreamDelta, StreamError
from actors.outbox import raise_stream_error
from actors.subscribers import SUBSCRIBER_LEASE_S, SUBSCRIBER_RENEW_EVERY_S
from router.engine_client import answer_within

log = logging.getLogger(__name__)


class OutputStreams:
    def __init__(self) -> None:
        self.sub = f"router-{uuid.uuid4().hex[:12]}"   # this replica, to the actors
        self._queues: dict[str, tuple[Hashable, asyncio.Queue]] = {}
        self._readers: dict[Hashable, tuple[Any, asyncio.Task]] = {}
        self._subscribed: dict[Hashable, asyncio.Future] = {}
        self._leases: dict[Hashable, tuple[Any, asyncio.Task]] = {}

    def __reduce__(self):
        # A copy (a client pickled to another process) is a new subscriber: sharing our id
        # would make the actors hand our stream over to it.
        return (OutputStreams, ())

    async def open(self, request_id: str, key: Hashable, actor: Any,
                   timeout_s: float = 60.0) -> None:
        """Make the request's queue; returns once the actor's stream to us is subscribed
        (raises what broke it, e.g. RayActorError, if that fails)."""
        self._queues[request_id] = (key, asyncio.Queue())
        await self.subscribe(key, actor, timeout_s)

    async def subscribe(self, key: Hashable, actor: Any, timeout_s: float = 60.0) -> None:
        """Start reading `actor`'s stream to us unless a live reader does; wait until it holds
        (clients call this for every engine when they start, so requests find it ready)."""
        self.lease(key, actor)
        if not _running(self._readers.get(key), actor):
            old = self._readers.get(key)
            if old is not None:
                old[1].cancel()       # it read a replaced actor (a restarted replica)
            loop = asyncio.get_running_loop()
            self._subscribed[key] = loop.create_future()
            # A fresh context: the stream must not count as a child of the request that
            # happened to start it (Ray keeps the calling task in a context variable, and
            # cancelling a request cancels the Ray calls it made).
            self._readers[key] = (actor, loop.create_task(self._read(key, actor),
                                                          context=contextvars.Context()))
        await asyncio.wait_for(asyncio.shield(self._subscribed[key]), timeout_s)

    def lease(self, key: Hashable, actor: Any) -> None:
        """Keep our subscriber lease on `actor` renewed (actors/subscribers.py): every
        SUBSCRIBER_RENEW_EVERY_S while it lives. A replaced actor's renewals stop."""
        if _running(self._leases.get(key), actor):
            return
        old = self._leases.get(key)
        if old is not None:
            old[1].cancel()
        loop = asyncio.get_running_loop()
        self._leases[key] = (actor, loop.create_task(self._renew(key, actor),
                                                     context=contextvars.Context()))

    async def _renew(self, key: Hashable, actor: Any) -> None:
        while True:
            try:
                await answer_within(actor.keepalive.remote(self.sub), SUBSCRIBER_LEASE_S)
            except RayActorError:
                return              # it died: nothing left to keep
            except Exception as e:  # noqa: BLE001 - a late answer: the next one may do
                log.info("lease renewal on %s failed: %r", key, e)
            await asyncio.sleep(SUBSCRIBER_RENEW_EVERY_S)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End the request's stream with `error` (raised by deltas())."""
        entry = self._queues.get(request_id)
        if entry is not None:
            entry[1].put_nowait(error)

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def deltas(self, request_id: str, timeout_s: float) -> AsyncIterator[StreamDelta]:
        """The request's deltas until its finished one; `timeout_s` bounds each wait."""
        _, queue = self._queues[request_id]
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no output for {request_id} in {timeout_s:g} s") from None
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, StreamError):
                raise_stream_error(item)
            yield item
            if item.finished:
                return

    async def _read(self, key: Hashable, actor: Any) -> None:
        error: BaseException
        subscribed = self._subscribed[key]
        try:
            async for ref in actor.outputs.options(num_returns="streaming").remote(self.sub):
                batch = await ref
                if not subscribed.done():
                    subscribed.set_result(None)
                for request_id, item in batch:
                    entry = self._queues.get(request_id)
                    if entry is not None:
                        entry[1].put_nowait(item)
            error = EngineFailed("the engine's output stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to every request reading from it
            log.warning("output stream of %s broke: %r", key, e)
            error = e
        if not subscribed.done():
            subscribed.set_exception(error)
            subscribed.exception()   # retrieved: no "never retrieved" warning if nobody waits
        for k, queue in list(self._queues.values()):
            if k == key:
                queue.put_nowait(error)


def _running(entry: tuple[Any, asyncio.Task] | None, actor: Any) -> bool:
    """Whether `entry` is a live task of this event loop for this very actor (by id: each
    membership update brings new handles to the same actors; a task of another loop is
    dead: tests run one loop after another)."""
    if entry is None:
        return False
    held, task = entry
    same = getattr(held, "_actor_id", held) == getattr(actor, "_actor_id", actor)
    return same and not task.done() and task.get_loop() is asyncio.get_running_loop()
