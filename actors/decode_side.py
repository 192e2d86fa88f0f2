"""DecodeSide: an engine replica serving as D takes requests whose prompt KV another engine
computes, and decodes them. The EngineActor (actors/engine_actor.py) owns the engine loop,
its KVEndpoint, the handoff and the outbox; this is what it does with them while it serves D.

Lifecycle of a request:
    reserve(id, ids, params)   → prealloc: blocks for the whole prompt (prefix-cache hits kept),
                                 parked as WAITING_FOR_KV under a lease (renewed by the router
                                 while the prefill runs); returns a KVDestination
    (the prefill side computes the prompt; push: it writes the KV into those blocks)
    decode(id, prefill result) → transfer: the handoff's `receive` returns once the prompt KV
                                 is in the reserved blocks (push: every write of the prefill
                                 side landed; pool: the blocks past our prefix hit read from
                                 the pool, and the request's hold there ended). If it cannot
                                 be (a failed or expired transfer, a block missing from the
                                 pool), the blocks are freed and decode raises
    waiting → running          → the request joins the continuous batch with its first token;
                                 its outputs go to the caller's stream (`outputs`, see
                                 actors/streaming.py), and decode() returns
    abort / lease expiry       → blocks freed; a stream ends with finish_reason "abort"
    the router's subscriber lease expires (it died; actors/subscribers.py)
                               → its reservations dropped and its streams aborted
D also prefills short prompts itself (`generate`, conditional disaggregation and fallback).
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from actors.handoff import opened
from actors.messages import KVDestination, PrefillResult
from pd_cluster.sampling_params import SamplingParams


class DecodeSide:
    """D's requests on `actor` (an EngineActor: its `loop`, `end`, `handoff`, `subscribers`,
    `outbox`); `lease_s`: how long a reservation waits for its KV without a renewal."""

    def __init__(self, actor: Any, lease_s: float) -> None:
        self.actor, self.lease_s = actor, lease_s
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._dests: dict[str, KVDestination] = {}   # reservations, beside their leases
        # Recent requests' (id, decode called, KV landed): see PrefillSide.stages.
        self.stages: collections.deque = collections.deque(maxlen=4096)

    async def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      sub: str | None = None) -> KVDestination | None:
        """Preallocate the prompt's blocks; None when the KV cache has no room now. `sub`: the
        router replica it is for; its lease expiring drops the reservation."""
        actor = self.actor
        got = await actor.loop.call(lambda e: e.reserve(prompt_ids, params, request_id))
        if got is None:
            return None
        actor.subscribers.track(sub, request_id)
        _, block_ids, cached = got
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.lease_s, self._drop_reservation, request_id)
        dest = KVDestination(actor.end.encoded_descriptor, actor.end.descriptor.agent,
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
        self.actor.subscribers.done(request_id)
        self._dests.pop(request_id, None)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()
        self.actor.loop.abort(request_id)

    async def decode(self, request_id: str, result: PrefillResult, sub: str) -> None:
        """Once the prompt KV from `result` is in the reserved blocks, continue the request
        with its first token; its outputs go to `sub`'s stream. Raises if the KV did not
        arrive."""
        actor = self.actor
        lease, dest = self._leases.pop(request_id, None), self._dests.pop(request_id, None)
        if lease is None:
            raise RuntimeError(f"request {request_id!r} holds no KV reservation here (expired?)")
        lease.cancel()
        called = time.monotonic()
        try:
            await opened(actor.handoff).receive(request_id, dest, result)
        except BaseException:
            self._drop_reservation(request_id)
            raise
        self.stages.append((request_id, called, time.monotonic()))
        actor.subscribers.done(request_id)      # from here on the outbox tracks it
        actor.loop.resume_into(request_id, result.token, result.logprobs,
                               actor.outbox.queue(sub, request_id))

    async def abort(self, request_id: str) -> None:
        """Drop the request; returns once the engine has, so that the caller may reuse its
        id at once (D prefilling it itself): an abort still queued would end that one."""
        self._drop_reservation(request_id)
        await self.actor.loop.call(lambda engine: None)   # the engine's commands run in order

    def subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: drop its reservations, end its streams."""
        for request_id in request_ids:
            self._drop_reservation(request_id)
        self.actor.outbox.close(sub)
