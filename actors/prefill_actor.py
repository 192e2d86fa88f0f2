"""PrefillActor: computes prompts' KV and pushes it, layer by layer, into decode engines.

Lifecycle of a request:
    prefill(id, ids, params, [dest]) → starts at once; when D's reservation (dest) resolves,
                                      the pusher learns which remote blocks receive which local
                                      ones and issues the writes that waited for that
    waiting → prefilling            → (chunked) prefill in the engine's continuous batch; after
                                      each layer the pusher queues that layer's writes, so the
                                      transfer overlaps the next layer's compute
    first token sampled             → the request holds its KV blocks (TRANSFERRING)
    in flight → done                → every write landed: blocks released (they stay in the
                                      prefix cache) and a PrefillResult goes back to the caller
    failure / abort / timeout       → writes aborted (the decode side is told), blocks freed,
                                      the caller gets the error
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from actors.engine_loop import EngineLoop
from actors.kv_push import KVPusher
from actors.messages import KVDestination, PrefillResult
from actors.transport_pump import open_pump
from pd_cluster.config import EngineConfig
from pd_cluster.sampling_params import SamplingParams
from transfer.messages import PoolDescriptor


@ray.remote
class PrefillActor:
    def __init__(self, config: EngineConfig, replica_id: int, transport: str,
                 timeout_s: float = 120.0) -> None:
        self.replica_id, self.timeout_s = replica_id, timeout_s
        self.loop = EngineLoop(config, timeout_s)
        engine = self.loop.engine
        self.descriptor, self.pump = open_pump(engine, transport, timeout_s,
                                               f"prefill-{replica_id}-kv")
        self.pusher = KVPusher(self.pump, config.block_size, engine.runner.device)
        self.loop.listener = self.pusher
        self._peers: set[str] = set()
        self.kv_bytes, self.transfer_s = 0, 0.0
        self._fail_next = 0
        self._releases: set[asyncio.Future] = set()

    def pool(self) -> bytes:
        return self.descriptor.encode()

    async def connect(self, pools: list[bytes]) -> None:
        """Open channels to decode pools up front (two-sided transports need both ways)."""
        for pool in pools:
            await self._connect_pool(pool)

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      dest: list) -> PrefillResult:
        """Prefill the prompt into the destination `dest[0]` (an ObjectRef of D's
        KVDestination, left unresolved in a list so the prefill starts while D reserves);
        returns the first token once its KV has landed."""
        self.pusher.add(request_id)
        destination = asyncio.ensure_future(self._destination(request_id, dest[0]))
        last, ok = None, False
        try:
            async for out in self.loop.stream(request_id, prompt_ids, params, hold_kv=True):
                last = out
            dest = await asyncio.wait_for(destination, self.timeout_s)
            if last is None or last.outputs[0].finish_reason == "abort":
                raise RuntimeError(f"prefill of {request_id} was aborted")
            if self._fail_next:
                self._fail_next -= 1
                self.pusher.fail(request_id, "injected transfer failure")
            start = time.monotonic()
            ids = await asyncio.wait_for(asyncio.wrap_future(self.pusher.finish(request_id)),
                                         self.timeout_s)
            ok = True
        finally:
            if not ok:
                destination.cancel()
                self.pusher.abort(request_id)
            # Freeing the blocks need not delay the answer (nor TTFT): queue it and go on.
            self._releases.add(asyncio.ensure_future(
                self.loop.call(lambda e: e.release(request_id))))
            self._releases = {t for t in self._releases if not t.done()}
        o = last.outputs[0]
        nbytes = self._bytes_of(dest, len(prompt_ids))
        elapsed = time.monotonic() - start
        self.kv_bytes += nbytes
        self.transfer_s += elapsed
        return PrefillResult(o.token_ids[0], o.logprobs[0] if o.logprobs else None,
                             self.descriptor.encode(), self.descriptor.agent, ids,
                             last.num_cached_tokens, nbytes, elapsed, last)

    async def _destination(self, request_id: str, ref) -> KVDestination:
        dest = await ref
        if dest is None:
            raise RuntimeError(f"{request_id}: the decode replica had no room to reserve KV")
        await self._connect(dest)
        self.pusher.set_destination(request_id, dest.agent, dest.block_ids,
                                    dest.num_cached_tokens)
        return dest

    async def _connect(self, dest: KVDestination) -> None:
        if dest.agent not in self._peers:
            await self._connect_pool(dest.pool)

    async def _connect_pool(self, pool: bytes) -> None:
        peer = PoolDescriptor.decode(pool)
        await asyncio.wrap_future(self.pump.call(lambda tr: tr.connect(peer)))
        self._peers.add(peer.agent)

    def _bytes_of(self, dest: KVDestination, prompt_len: int) -> int:
        layout = self.descriptor.layout
        sent_blocks = -(-prompt_len // layout.block_size) - dest.num_cached_tokens // layout.block_size
        return sent_blocks * layout.block_bytes * 2 * layout.num_layers

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)
        self.pusher.abort(request_id)

    async def fail_next_transfer(self) -> None:
        """Fault injection for tests: abort the next request's KV writes before they settle."""
        self._fail_next += 1

    async def load(self) -> dict[str, Any]:
        return {**self.loop.load(), "replica_id": self.replica_id,
                "kv_bytes_transferred": self.kv_bytes, "kv_transfer_seconds": self.transfer_s,
                "transport": self.descriptor.backend}

    async def timeline(self) -> list[tuple[str, int, float]]:
        """Per-layer (\"computed\" | \"posted\", layer, time) marks of the pusher."""
        return list(self.pusher.timeline)
