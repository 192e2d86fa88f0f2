"""Outbox: all of a subscriber's request outputs from one engine actor, on one Ray stream.

A Ray streaming generator per request costs a Ray object per token on both ends (about 1k
objects/s per core measured on the CPU dev box), which at a decode batch of 128 cost more
than the step itself. The outbox sends one message per engine step and subscriber (a router
replica) instead, carrying every request's delta.

Lifecycle of a subscriber's stream:
    queue(sub)     its asyncio queue, made on first use; the EngineLoop thread puts
                   (request id, RequestOutput | Exception) items on it, a step's worth at once
    stream(sub)    first yields an empty batch (the subscription holds from then on: start
                   requests only after it), then waits for an item, and yields everything
                   queued as one batch of
                   (request id, StreamDelta | StreamError) — the actor's `outputs` method
                   is a Ray streaming generator over it; Ray's backpressure on that
                   generator makes the batches larger, never the queue unbounded in count
                   of messages
    stream closed  (the subscriber went away) → `on_gone(sub, request ids)` lets the actor
                   abort the requests nobody will read
    close(sub)     the same, when the subscriber's lease expired (actors/subscribers.py): a
                   dead router's stream need not close for its requests to end
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from actors.engine_loop import EngineFailed, RequestRejected
from actors.messages import StreamDelta, StreamError, StreamErrorKind
from pd_cluster.outputs import RequestOutput

Batch = list[tuple[str, "StreamDelta | StreamError"]]


class _Mailbox:
    """A subscriber's current queue; a new stream for the same subscriber (its event loop was
    replaced) takes the queue over, and the old stream ends."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def put_nowait(self, item: tuple) -> None:
        self.queue.put_nowait(item)


_SUPERSEDED = object()


class Outbox:
    def __init__(self, on_gone: Callable[[list[str]], None]) -> None:
        self._boxes: dict[str, _Mailbox] = {}
        self._open: dict[str, set[str]] = {}   # subscriber → its unfinished request ids
        self.on_gone = on_gone

    def queue(self, sub: str, request_id: str) -> _Mailbox:
        """Where `request_id`'s outputs go (call on the actor's event loop)."""
        self._open.setdefault(sub, set()).add(request_id)
        return self._boxes.setdefault(sub, _Mailbox())

    async def stream(self, sub: str) -> AsyncIterator[Batch]:
        box = self._boxes.setdefault(sub, _Mailbox())
        old, box.queue = box.queue, asyncio.Queue()
        while not old.empty():
            item = old.get_nowait()
            if item is not _SUPERSEDED:
                box.queue.put_nowait(item)
        old.put_nowait(_SUPERSEDED)    # wakes the stream that read `old`, if any: it ends
        queue, open_ids = box.queue, self._open.setdefault(sub, set())
        superseded = False
        try:
            yield []   # "subscribed": from here on, this stream gets every output
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                superseded = items[-1] is _SUPERSEDED
                if superseded:
                    return
                yield [self._message(open_ids, rid, item) for rid, item in items]
        finally:
            if not superseded and box.queue is queue:   # the subscriber went away
                self._boxes.pop(sub, None)
                gone = self._open.pop(sub, set())
                if gone:
                    self.on_gone(sorted(gone))

    def close(self, sub: str) -> None:
        """The subscriber is gone (its lease expired): end its stream if one is still open
        and hand its unfinished requests to `on_gone`."""
        box = self._boxes.pop(sub, None)
        gone = self._open.pop(sub, set())
        if box is not None:
            box.queue.put_nowait(_SUPERSEDED)   # the stream reading it ends
        if gone:
            self.on_gone(sorted(gone))

    @staticmethod
    def _message(open_ids: set[str], rid: str, item: RequestOutput | Exception
                 ) -> tuple[str, StreamDelta | StreamError]:
        if isinstance(item, Exception):
            open_ids.discard(rid)
            return rid, StreamError.of(item)
        if item.finished:
            open_ids.discard(rid)
        return rid, StreamDelta.of(item)


def raise_stream_error(error: StreamError) -> None:
    """Re-raise an engine's error on the subscriber's side, as the same kind of exception."""
    if error.kind is StreamErrorKind.REJECTED:
        raise RequestRejected(error.message)
    if error.kind is StreamErrorKind.TIMEOUT:
        raise TimeoutError(error.message)
    raise EngineFailed(error.message)
