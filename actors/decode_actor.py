"""DecodingActor: takes requests whose prompt KV another engine computes, and decodes them.

Lifecycle of a request:
    reserve(id, ids, params)   → prealloc: blocks for the whole prompt (prefix-cache hits kept),
                                 parked as WAITING_FOR_KV under a lease (renewed by the router
                                 while the prefill runs); returns a KVDestination
    (a PrefillActor writes the KV into those blocks)
    decode(id, prefill result) → transfer: wait, off the engine thread, until every write the
                                 prefill side made has landed (a failed or expired transfer
                                 frees the blocks and raises)
    waiting → running          → the request joins the continuous batch with its first token;
                                 its outputs go to the caller's stream (`outputs`, see
                                 actors/streaming.py), and decode() returns
    abort / lease expiry       → blocks freed; a stream ends with finish_reason "abort"
Pooled mode (`attach_kv_cache` first; the prefill result carries `pool_keys`): at transfer,
D reads the prompt blocks it lacks (past its own prefix hit) from the DistributedKVCache into
the reserved blocks, then releases the request's hold there, whether or not the read worked.
A block missing from the pool fails the request like a failed transfer.
It also prefills short prompts itself (`generate`, conditional disaggregation and fallback).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import ray

from actors.engine_loop import EngineLoop
from actors.kv_push import expect_transfers
from actors.messages import DECODE, KVDestination, PrefillResult, ReplicaLoad
from actors.pool_client import PumpKVCacheClient
from actors.streaming import StreamingEngine
from actors.transport_pump import open_pump
from pd_cluster.config import EngineConfig
from pd_cluster.sampling_params import SamplingParams
from transfer.base import TransferError
from transfer.messages import KVDescriptor


@ray.remote
class DecodingActor(StreamingEngine):
    def __init__(self, config: EngineConfig, replica_id: int, transport: str,
                 timeout_s: float = 120.0, lease_s: float = 60.0) -> None:
        self.replica_id, self.timeout_s, self.lease_s = replica_id, timeout_s, lease_s
        self.loop = EngineLoop(config, timeout_s, DECODE, replica_id)
        self._open_outbox()
        engine = self.loop.engine
        self.descriptor, self.pump = open_pump(engine, transport, timeout_s,
                                               f"decode-{replica_id}-kv")
        self._peers: set[str] = set()
        self._leases: dict[str, asyncio.TimerHandle] = {}
        self._dests: dict[str, KVDestination] = {}   # reservations, beside their leases
        self.kv_bytes, self.transfer_s = 0, 0.0
        self.kv_cache: PumpKVCacheClient | None = None  # pooled mode
        # Recent requests' (id, decode called, KV landed): see PrefillActor.stages.
        self.stages: collections.deque = collections.deque(maxlen=4096)

    async def reserve(self, request_id: str, prompt_ids: list[int],
                      params: SamplingParams) -> KVDestination | None:
        """Preallocate the prompt's blocks; None when the KV pool has no room now."""
        got = await self.loop.call(lambda e: e.reserve(prompt_ids, params, request_id))
        if got is None:
            return None
        _, block_ids, cached = got
        self._leases[request_id] = asyncio.get_running_loop().call_later(
            self.lease_s, self._expire, request_id)
        dest = KVDestination(self.descriptor.encode(), self.descriptor.agent, block_ids, cached)
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
        self._leases.pop(request_id, None)
        self._dests.pop(request_id, None)
        self.loop.abort(request_id)

    async def decode(self, request_id: str, result: PrefillResult, sub: str) -> None:
        """Once the prompt KV from `result` has landed, continue the request with its first
        token; its outputs go to `sub`'s stream. Raises if the KV did not land."""
        lease, dest = self._leases.pop(request_id, None), self._dests.pop(request_id, None)
        if lease is None:
            raise RuntimeError(f"request {request_id!r} holds no KV reservation here (expired?)")
        lease.cancel()
        called = time.monotonic()
        try:
            if result.pool_keys is None:
                await self._connect(result)
                await asyncio.wait_for(asyncio.wrap_future(
                    expect_transfers(self.pump, result.agent, result.transfer_ids)),
                    self.timeout_s)
                self.kv_bytes += result.kv_bytes
                self.transfer_s += result.transfer_s
            else:
                await self._pull(request_id, dest, result.pool_keys)
        except BaseException:
            self.loop.abort(request_id)
            raise
        self.stages.append((request_id, called, time.monotonic()))
        self.loop.resume_into(request_id, result.token, result.logprobs,
                              self.outbox.queue(sub, request_id))

    async def stage_times(self) -> list[tuple[str, float, float]]:
        """(request id, decode called, KV landed) of recent requests."""
        return list(self.stages)

    async def attach_kv_cache(self, kv_cache) -> None:
        """Pooled mode: read prompt KV from this DistributedKVCache actor (connects both ways)."""
        self.kv_cache = PumpKVCacheClient(kv_cache, self.pump, self.timeout_s)
        await self.kv_cache.connect()

    async def _pull(self, request_id: str, dest: KVDestination, keys: list) -> None:
        """Read the prompt blocks past our own prefix hit from the KV cache, then release the
        request's hold there."""
        layout = self.descriptor.layout
        skip = dest.num_cached_tokens // layout.block_size
        start = time.monotonic()
        try:
            got = await asyncio.wait_for(self.kv_cache.get(keys[skip:], dest.block_ids[skip:]),
                                         self.timeout_s)
        finally:
            self.kv_cache.release(request_id)
        if got < len(keys) - skip:
            raise TransferError(f"{request_id}: the KV cache holds {got} of the "
                                f"{len(keys) - skip} prompt blocks to read")
        self.kv_bytes += got * layout.block_bytes * 2 * layout.num_layers
        self.transfer_s += time.monotonic() - start

    async def _connect(self, result: PrefillResult) -> None:
        if result.agent not in self._peers:
            await self.connect([result.pool])

    async def connect(self, pools: list[bytes]) -> None:
        """Open channels to prefill pools up front: two-sided transports (ucx, ray) acknowledge
        each write, and control messages (leases, aborts) flow this way too."""
        for pool in pools:
            peer = KVDescriptor.decode(pool)
            await asyncio.wrap_future(self.pump.call(lambda tr: tr.connect(peer)))
            self._peers.add(peer.agent)

    async def pool(self) -> bytes:
        return self.descriptor.encode()

    # generate() (StreamingEngine): prefill here too (conditional disaggregation, or
    # recompute after a failed prefill).

    async def abort(self, request_id: str) -> None:
        self._dests.pop(request_id, None)
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            lease.cancel()
        self.loop.abort(request_id)

    async def load(self) -> ReplicaLoad:
        return dataclasses.replace(self.loop.load(), kv_bytes_transferred=self.kv_bytes,
                                   kv_transfer_seconds=self.transfer_s,
                                   transport=self.descriptor.backend)
