"""DecodingActor: takes requests whose prompt KV another engine computes, and decodes them.

Lifecycle of the actor: it starts its engine and a transport over the engine's KV cache
(its KVEndpoint); once every replica is up the router opens the deployment's KV handoff on it
(`open_handoff`, actors/handoff.py: push, or through the KV pool).
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
It also prefills short prompts itself (`generate`, conditional disaggregation and fallback).
"""
from __future__ import annotations

import asyncio
import collections
import time

import ray

from actors.engine_loop import EngineLoop
from actors.handoff import KVEndpoint, KVHandoff, opened
from actors.messages import DECODE, KVDestination, PrefillResult, ReplicaLoad
from actors.streaming import StreamingEngine
from pd_cluster.config import EngineConfig
from pd_cluster.sampling_params import SamplingParams


@ray.remote
class DecodingActor(StreamingEngine):
    def __init__(self, config: EngineConfig, replica_id: int, transport: str,
                 timeout_s: float = 120.0, lease_s: float = 60.0) -> None:
        self.lease_s = lease_s
        self.loop = EngineLoop(config, timeout_s, DECODE, replica_id)
        self._open_outbox()
        self.end = KVEndpoint(self.loop, transport, timeout_s, f"decode-{replica_id}-kv")
        self.handoff: KVHandoff | None = None   # the router's, once opened here
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._dests: dict[str, KVDestination] = {}   # reservations, beside their leases
        # Recent requests' (id, decode called, KV landed): see PrefillActor.stages.
        self.stages: collections.deque = collections.deque(maxlen=4096)

    def kv_descriptor(self) -> bytes:
        """The encoded KVDescriptor of this engine's KV cache."""
        return self.end.encoded_descriptor

    async def open_handoff(self, handoff: KVHandoff, peers: list[bytes]) -> None:
        """Receive the KV of every prompt this way from now on; `peers`: the prefill engines'
        KV descriptors, for a handoff that addresses them."""
        await handoff.open_decode(self.end, peers)
        self.handoff = handoff

    async def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      sub: str | None = None) -> KVDestination | None:
        """Preallocate the prompt's blocks; None when the KV cache has no room now. `sub`: the
        router replica it is for; its lease expiring drops the reservation."""
        got = await self.loop.call(lambda e: e.reserve(prompt_ids, params, request_id))
        if got is None:
            return None
        self.subscribers.track(sub, request_id)
        _, block_ids, cached = got
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.lease_s, self._expire, request_id)
        dest = KVDestination(self.end.encoded_descriptor, self.end.descriptor.agent,
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
            self.lease_s, self._expire, request_id)
        return True

    def _expire(self, request_id: str) -> None:
        # Nobody came to decode it (the router or the prefill side died): free its blocks.
        self._drop_reservation(request_id)

    def _drop_reservation(self, request_id: str) -> None:
        """The one way a request leaves here before its KV landed (abort, lease expiry, a
        failed transfer): lease and destination forgotten, the engine aborts it."""
        self.subscribers.done(request_id)
        self._dests.pop(request_id, None)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()
        self.loop.abort(request_id)

    async def decode(self, request_id: str, result: PrefillResult, sub: str) -> None:
        """Once the prompt KV from `result` is in the reserved blocks, continue the request
        with its first token; its outputs go to `sub`'s stream. Raises if the KV did not
        arrive."""
        lease, dest = self._leases.pop(request_id, None), self._dests.pop(request_id, None)
        if lease is None:
            raise RuntimeError(f"request {request_id!r} holds no KV reservation here (expired?)")
        lease.cancel()
        called = time.monotonic()
        try:
            await opened(self.handoff).receive(request_id, dest, result)
        except BaseException:
            self._drop_reservation(request_id)
            raise
        self.stages.append((request_id, called, time.monotonic()))
        self.subscribers.done(request_id)      # from here on the outbox tracks it
        self.loop.resume_into(request_id, result.token, result.logprobs,
                              self.outbox.queue(sub, request_id))

    def _subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: drop its reservations, end its streams."""
        for request_id in request_ids:
            self._drop_reservation(request_id)
        self.outbox.close(sub)

    async def add_peer(self, descriptor: bytes) -> None:
        """Connect to a prefill engine that joined after us (a restarted replica)."""
        await self.end.connect(descriptor)

    async def stage_times(self) -> list[tuple[str, float, float]]:
        """(request id, decode called, KV landed) of recent requests."""
        return list(self.stages)

    # generate() (StreamingEngine): prefill here too (conditional disaggregation, or
    # recompute after a failed prefill).

    async def abort(self, request_id: str) -> None:
        self._drop_reservation(request_id)

    async def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """The engine's load report (see KVEndpoint.load, EngineLoop.load)."""
        return self.end.load(prefix_since)
