"""DecodeSide: an engine replica serving as D takes requests whose prompt KV another engine
computes (its KVReceiver, actors/handoff.py), and decodes them. The EngineActor
(actors/engine_actor.py) owns the engine loop, its KVEndpoint, the subscriber leases and the
outbox (what `DecodeHost` names); this is what it does with them while it serves D. (The
whole exchange of router, P and D: router/disagg_client.py.)

Lifecycle of a request:
    reserve(id, ids, params)   → prealloc: blocks for the whole prompt (prefix-cache hits kept),
                                 parked as WAITING_FOR_KV under a lease (renewed by the router
                                 while the prefill runs); returns a KVDestination
    (the prefill side computes the prompt; push: it writes the KV into those blocks)
    decode(id, prefill result, first_sent)
                               → transfer: the receiver's `receive` returns once the prompt KV
                                 is in the reserved blocks (push: every write of the prefill
                                 side landed; pool: the blocks past our prefix hit read from
                                 the pool, and the request's hold there ended). If it cannot
                                 be (a failed or expired transfer, a block missing from the
                                 pool), the blocks are freed and decode raises
    waiting → running          → the request joins the continuous batch with its first token;
                                 its outputs go to the caller's stream (`outputs`, see
                                 actors/streaming.py), and decode() returns. With `first_sent`
                                 (the caller has P's first token) the stream starts after it
    abort / lease expiry       → blocks freed; a stream ends with finish_reason "abort"
    the router's subscriber lease expires (it died; actors/subscribers.py)
                               → its reservations dropped and its streams aborted
D also prefills prompts itself (`generate`: conditional disaggregation, and the fallbacks),
its stream after the first token too when the caller has P's.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol, runtime_checkable

from actors.engine_loop import EngineLoop
from actors.handoff import KVEndpoint, KVHandoff, KVReceiver, opened
from actors.messages import DecodeTimes, KVDestination, PrefillResult, after_first_token
from actors.outbox import Outbox
from actors.subscribers import Subscribers
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams


@runtime_checkable
class DecodeHost(Protocol):
    """What DecodeSide uses of the engine actor that holds it (EngineActor)."""

    loop: EngineLoop                # runs the requests
    end: KVEndpoint                 # the KV cache's transport: the receiver's, our descriptor
    subscribers: Subscribers        # the router replicas' leases on the reservations
    outbox: Outbox                  # the router replicas' streams of outputs


class DecodeSide:
    """D's requests on `host`'s engine; `lease_s`: how long a reservation waits for its KV
    without a renewal; `receiver`: its part of the handoff, once opened."""

    def __init__(self, host: DecodeHost, lease_s: float) -> None:
        self.host, self.lease_s = host, lease_s
        self.receiver: KVReceiver | None = None
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._dests: dict[str, KVDestination] = {}   # reservations, beside their leases
        # Recent requests' (id, decode called, KV landed): see PrefillSide.stages.
        self.stages: collections.deque = collections.deque(maxlen=4096)

    async def open(self, handoff: KVHandoff, peers: list[bytes]) -> None:
        """Take prompts' KV this way from now on (the controller opens the handoff)."""
        self.receiver = await handoff.open_decode(self.host.end, peers)

    def close(self) -> None:
        """No handoff any more (the engine changes roles) until `open` again."""
        self.receiver = None

    async def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      sub: str | None = None) -> KVDestination | None:
        """Preallocate the prompt's blocks; None when the KV cache has no room now. `sub`: the
        router replica it is for; its lease expiring drops the reservation."""
        host = self.host
        got = await host.loop.call(lambda e: e.reserve(prompt_ids, params, request_id))
        if got is None:
            return None
        host.subscribers.track(sub, request_id)
        host.end.pump.expect()                  # P's writes into these blocks come next
        _, block_ids, cached = got
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.lease_s, self._drop_reservation, request_id)
        dest = KVDestination(host.end.encoded_descriptor, host.end.descriptor.agent,
                             block_ids, cached)
        self._dests[request_id] = dest
        return dest

    async def renew(self, request_id: str) -> bool:
        """Extend a reservation's lease (its prefill is still running); False if it is gone."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        lease.cancel()
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.lease_s, self._drop_reservation, request_id)
        return True

    def _drop_reservation(self, request_id: str) -> None:
        """The one way a request leaves here before its KV landed (abort, lease expiry: nobody
        came to decode it, a failed transfer): lease and destination forgotten, the engine
        aborts it."""
        self.host.subscribers.done(request_id)
        self._dests.pop(request_id, None)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()
        self.host.loop.abort(request_id)

    async def decode(self, request_id: str, result: PrefillResult, sub: str,
                     first_sent: bool) -> DecodeTimes:
        """Once the prompt KV from `result` is in the reserved blocks, continue the request
        with its first token; its outputs go to `sub`'s stream, after the first token when
        `first_sent` (the caller has it from P). Raises if the KV did not arrive. Returns
        when it was called and when the KV had landed (a request trace's landing)."""
        host = self.host
        lease, dest = self._leases.pop(request_id, None), self._dests.pop(request_id, None)
        if lease is None:
            raise RuntimeError(f"request {request_id!r} holds no KV reservation here (expired?)")
        lease.cancel()
        called = time.monotonic()
        try:
            await opened(self.receiver).receive(request_id, dest, result)
        except BaseException:
            self._drop_reservation(request_id)
            raise
        landed = time.monotonic()
        self.stages.append((request_id, called, landed))
        host.subscribers.done(request_id)      # from here on the outbox tracks it
        host.loop.resume_into(request_id, result.token, result.logprobs,
                              self._stream(sub, request_id, first_sent))
        return DecodeTimes(called, landed, time.time() - time.monotonic())

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       sub: str, first_sent: bool = False) -> None:
        """Prefill the prompt here and decode it (the route leaves the prefill to D, or a
        fallback); its outputs go to `sub`'s stream, after the first token when `first_sent`
        (the caller has P's). First the receiver's prefetch (pool: the prompt's prefix blocks
        a KV pool holds); returns once the request is queued."""
        host = self.host
        release = (await self.receiver.prefetch(prompt_ids, params.cache_salt)
                   if self.receiver is not None
                   else (lambda: None))
        try:
            host.subscribers.renew(sub)
            host.loop.submit(request_id, prompt_ids, params,
                             self._stream(sub, request_id, first_sent))
        finally:
            release()   # queued after the request: it is admitted with them cached

    def _stream(self, sub: str, request_id: str, first_sent: bool) -> Inbox:
        """Where the engine puts the request's outputs: `sub`'s outbox."""
        box = self.host.outbox.queue(sub, request_id)
        return _AfterFirst(box) if first_sent else box

    async def abort(self, request_id: str) -> None:
        """Drop the request; returns once the engine has, so that the caller may reuse its
        id at once (D prefilling it itself): an abort still queued would end that one."""
        self._drop_reservation(request_id)
        await self.host.loop.call(lambda engine: None)   # the engine's commands run in order

    def subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: drop its reservations, end its streams."""
        for request_id in request_ids:
            self._drop_reservation(request_id)
        self.host.outbox.close(sub)


class Inbox(Protocol):
    """Where an engine loop puts a request's (id, output | error) items (EngineLoop.submit)."""

    def put_nowait(self, item: tuple[str, RequestOutput | Exception]) -> None: ...


class _AfterFirst:
    """A request's way into its outbox when the caller has its first token already: the
    engine's first output of it, which carries that token alone (the one its prefill or its
    resume sampled), stays out (`after_first_token`); the rest go in."""

    def __init__(self, box: Inbox) -> None:
        self.box, self.first = box, True

    def put_nowait(self, item: tuple[str, RequestOutput | Exception]) -> None:
        request_id, out = item
        if self.first and isinstance(out, RequestOutput) and out.delta_token_ids:
            self.first = False
            out = after_first_token(out)
            if out is None:
                return
        self.box.put_nowait((request_id, out))
