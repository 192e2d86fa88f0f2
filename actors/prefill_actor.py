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
Pooled mode (no destination; `attach_kv_cache` first): the prompt is prefilled the same way,
then its blocks are put into the DistributedKVCache in one write, keyed by `prompt_keys` (full
blocks by prefix hash, a partial last block by request) and kept there under a hold named
by the request id for its decode engine; blocks the pool already has are not sent. It gives
up the layer-wise overlap for engines that never address each other. A failed or refused
put frees the pool's side and raises; the engine's blocks are freed either way.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import ray

from actors.engine_loop import EngineLoop
from actors.kv_push import KVPusher
from actors.messages import PREFILL, KVDestination, PrefillResult, ReplicaLoad
from actors.pool_client import PumpKVCacheClient
from actors.pool_index import prompt_keys
from actors.transport_pump import ms_percentiles, open_pump
from kernels import compiles
from pd_cluster.config import EngineConfig
from pd_cluster.engine import LLMEngine
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import FinishReason
from pd_cluster.sampling_params import SamplingParams
from transfer.messages import KVDescriptor


@ray.remote
class PrefillActor:
    def __init__(self, config: EngineConfig, replica_id: int, transport: str,
                 timeout_s: float = 120.0) -> None:
        self.replica_id, self.timeout_s = replica_id, timeout_s
        self.loop = EngineLoop(config, timeout_s, PREFILL, replica_id)
        engine = self.loop.engine
        self.descriptor, self.pump = open_pump(engine, transport, timeout_s,
                                               f"prefill-{replica_id}-kv")
        self.pusher = KVPusher(self.pump, config.block_size, engine.runner.device)
        self.loop.listener = self.pusher
        self._peers: set[str] = set()
        self.kv_bytes, self.transfer_s = 0, 0.0
        self._fail_next = 0
        self._releases: set[asyncio.Future] = set()
        self.kv_cache: PumpKVCacheClient | None = None  # pooled mode
        # Recent requests' stage times (called, prefilled, destination known, KV landed),
        # for diagnosing where a TTFT goes under load (bench/disagg_probe.py).
        self.stages: collections.deque = collections.deque(maxlen=4096)

    def pool(self) -> bytes:
        return self.descriptor.encode()

    async def connect(self, pools: list[bytes]) -> None:
        """Open channels to decode pools up front (two-sided transports need both ways)."""
        for pool in pools:
            await self._connect_pool(pool)

    async def attach_kv_cache(self, kv_cache) -> None:
        """Pooled mode: put prompt KV into this DistributedKVCache actor (connects both ways)."""
        self.kv_cache = PumpKVCacheClient(kv_cache, self.pump, self.timeout_s)
        await self.kv_cache.connect()

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      dest: list | None) -> PrefillResult:
        """Prefill the prompt into the destination `dest[0]` (an ObjectRef of D's
        KVDestination, left unresolved in a list so the prefill starts while D reserves), or
        with `dest` None into the DistributedKVCache; returns the first token once its KV
        has landed."""
        if dest is None:
            return await self._prefill_into_kv_cache(request_id, prompt_ids, params)
        self.pusher.add(request_id)
        destination = asyncio.ensure_future(self._destination(request_id, dest[0]))
        ok, called = False, time.monotonic()
        try:
            last = await self._first_output(request_id, prompt_ids, params)
            prefilled = time.monotonic()
            dest = await asyncio.wait_for(destination, self.timeout_s)
            if self._fail_next:
                self._fail_next -= 1
                self.pusher.fail(request_id, "injected transfer failure")
            start = time.monotonic()
            ids = await asyncio.wait_for(asyncio.wrap_future(self.pusher.finish(request_id)),
                                         self.timeout_s)
            ok = True
            self.stages.append((request_id, called, prefilled, start, time.monotonic()))
        finally:
            if not ok:
                destination.cancel()
                self.pusher.abort(request_id)
            self._release(request_id)
        return self._result(last, ids, self._bytes_of(dest, len(prompt_ids)), start)

    async def _prefill_into_kv_cache(self, request_id: str, prompt_ids: list[int],
                                     params: SamplingParams) -> PrefillResult:
        if self.kv_cache is None:
            raise RuntimeError("pooled prefill needs a DistributedKVCache: attach_kv_cache first")
        layout = self.descriptor.layout
        keys = prompt_keys(request_id, prompt_ids, layout.block_size)
        try:
            last = await self._first_output(request_id, prompt_ids, params)
            start = time.monotonic()
            blocks = await self.loop.call(lambda e: _held_blocks(e, request_id))
            if self._fail_next:
                self._fail_next -= 1
                await self.kv_cache.release(request_id)  # so the pool refuses the put
            added = await self.kv_cache.put(keys, blocks, hold=request_id)
        finally:
            self._release(request_id)
        nbytes = added * layout.block_bytes * 2 * layout.num_layers
        return dataclasses.replace(self._result(last, [], nbytes, start), pool_keys=keys)

    async def _first_output(self, request_id: str, prompt_ids: list[int],
                            params: SamplingParams) -> RequestOutput:
        """Run the prefill; its last output (the first token's), its KV blocks held."""
        last = None
        async for out in self.loop.stream(request_id, prompt_ids, params, hold_kv=True):
            last = out
        if last is None or last.outputs[0].finish_reason is FinishReason.ABORT:
            raise RuntimeError(f"prefill of {request_id} was aborted")
        return last

    def _release(self, request_id: str) -> None:
        # Freeing the blocks need not delay the answer (nor TTFT): queue it and go on.
        self._releases.add(asyncio.ensure_future(
            self.loop.call(lambda e: e.release(request_id))))
        self._releases = {t for t in self._releases if not t.done()}

    def _result(self, last: RequestOutput, transfer_ids: list[str], nbytes: int,
                start: float) -> PrefillResult:
        o, elapsed = last.outputs[0], time.monotonic() - start
        self.kv_bytes += nbytes
        self.transfer_s += elapsed
        return PrefillResult(o.token_ids[0], o.logprobs[0] if o.logprobs else None,
                             self.descriptor.encode(), self.descriptor.agent, transfer_ids,
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
        peer = KVDescriptor.decode(pool)
        await asyncio.wrap_future(self.pump.call(lambda tr: tr.connect(peer)))
        self._peers.add(peer.agent)

    def _bytes_of(self, dest: KVDestination, prompt_len: int) -> int:
        layout = self.descriptor.layout
        sent_blocks = -(-prompt_len // layout.block_size) - dest.num_cached_tokens // layout.block_size
        return sent_blocks * layout.block_bytes * 2 * layout.num_layers

    async def abort(self, request_id: str) -> None:
        def end(engine: LLMEngine) -> None:
            # Past its prefill a request is held, its stream over: it ends by release (the
            # engine has no stream left to abort). Else abort it; the command runs right
            # after this one, before any step could make it held.
            if request_id in engine.scheduler.holding:
                engine.release(request_id)
            else:
                self.loop.abort(request_id)
        self.pusher.abort(request_id)
        await self.loop.call(end)

    async def fail_next_transfer(self) -> None:
        """Fault injection for tests: abort the next request's KV writes before they settle
        (pooled mode: have the pool refuse its put)."""
        self._fail_next += 1

    async def load(self) -> ReplicaLoad:
        return dataclasses.replace(self.loop.load(), kv_bytes_transferred=self.kv_bytes,
                                   kv_transfer_seconds=self.transfer_s,
                                   transport=self.descriptor.backend)

    async def stage_times(self) -> list[tuple[str, float, float, float, float]]:
        """(request id, called, prefilled, destination known, KV landed) of recent requests."""
        return list(self.stages)

    async def diagnostics(self, since: float | None = None) -> dict:
        """The pump's command lag and slow iterations, and the engine's step durations; with
        `since` (monotonic), also the raw step log (began, ended, waiting, running) of the
        steps that began after it and the Triton kernels compiled since."""
        log = list(self.loop.step_log)
        out = {"pump": self.pump.stats(), "steps": len(log),
               **ms_percentiles("step", [b - a for a, b, *_ in log])}
        if since is not None:
            out["step_log"] = [row for row in log if row[0] >= since]
            out["kernel_compiles"] = compiles.since(since)
        return out

    async def timeline(self) -> list[tuple[str, int, float]]:
        """Per-layer (\"computed\" | \"posted\", layer, time) marks of the pusher."""
        return list(self.pusher.timeline)


def _held_blocks(engine: LLMEngine, request_id: str) -> list[int]:
    req = engine.scheduler.holding.get(request_id)
    if req is None:
        raise RuntimeError(f"prefill of {request_id} was aborted")
    return list(req.block_ids)
