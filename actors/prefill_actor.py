"""PrefillActor: computes prompts' KV and hands it over to decode engines (actors/handoff.py).

Lifecycle of the actor: it starts its engine and a transport over the engine's KV cache
(its KVEndpoint); once every replica is up the router opens the deployment's KV handoff on it
(`open_handoff`: push, or through the KV pool).
Lifecycle of a request:
    prefill(id, ids, params, destination)
                           → the handoff's `send` runs the prefill and hands the KV over
    waiting → prefilling   → (chunked) prefill in the engine's continuous batch (push: after
                             each layer that layer's writes go out, overlapping the next layer)
    first token sampled    → the request holds its KV blocks (TRANSFERRING) while the handoff
                             finishes (push: every write landed in D's blocks; pool: the
                             prompt's blocks put into the pool, held for D)
    handed over → done     → blocks released (they stay in the prefix cache) and a
                             PrefillResult goes back to the caller
    the router's subscriber lease expires (it died; actors/subscribers.py) → aborted
    failure / abort / timeout → the handover is abandoned (push: writes aborted, D is told;
                             pool: the put fails and frees the pool's side), blocks freed,
                             the caller gets the error
The engine steps synchronously in either handoff: a prompt's first token, and so its
handover, comes out of the step that computed it, not after the next step's launch.
"""
from __future__ import annotations

import asyncio
import collections
import time

import ray

from actors.engine_loop import EngineLoop
from actors.handoff import KVEndpoint, KVHandoff, opened
from actors.messages import PREFILL, PrefillResult, ReplicaLoad
from actors.subscribers import Subscribers
from actors.transport_pump import ms_percentiles
from kernels import compiles
from pd_cluster.config import EngineConfig
from pd_cluster.engine import LLMEngine
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import FinishReason
from pd_cluster.sampling_params import SamplingParams


@ray.remote
class PrefillActor:
    def __init__(self, config: EngineConfig, replica_id: int, transport: str,
                 timeout_s: float = 120.0) -> None:
        self.loop = EngineLoop(config.model_copy(update={"async_scheduling": False}),
                               timeout_s, PREFILL, replica_id)
        self.end = KVEndpoint(self.loop, transport, timeout_s, f"prefill-{replica_id}-kv")
        self.handoff: KVHandoff | None = None   # the router's, once opened here
        self._releases: set[asyncio.Future] = set()
        self.subscribers = Subscribers(self._subscriber_gone)
        # Recent requests' stage times (called, prefilled, handover started, KV in place),
        # for diagnosing where a TTFT goes under load (bench/disagg_probe.py).
        self.stages: collections.deque = collections.deque(maxlen=4096)

    def kv_descriptor(self) -> bytes:
        """The encoded KVDescriptor of this engine's KV cache."""
        return self.end.encoded_descriptor

    async def open_handoff(self, handoff: KVHandoff, peers: list[bytes]) -> None:
        """Hand the KV of every prompt over this way from now on; `peers`: the decode
        engines' KV descriptors, for a handoff that addresses them."""
        await handoff.open_prefill(self.end, peers)
        self.handoff = handoff

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      destination: list | None, sub: str | None = None) -> PrefillResult:
        """Prefill the prompt and hand its KV over (`destination`: what the router's handoff
        says of where it goes); returns the first token once the KV is in place. `sub`: the
        router replica it is for; its lease expiring aborts the prefill."""
        called = time.monotonic()
        self.subscribers.track(sub, request_id)
        try:
            sent = await opened(self.handoff).send(
                request_id, prompt_ids, destination,
                lambda: self._first_output(request_id, prompt_ids, params))
        finally:
            self.subscribers.done(request_id)
            self._release(request_id)
        landed = time.monotonic()
        self.stages.append((request_id, called, sent.prefilled, sent.started, landed))
        self.end.count(sent.kv_bytes, landed - sent.started)
        o = sent.last.outputs[0]
        return PrefillResult(o.token_ids[0], o.logprobs[0] if o.logprobs else None, sent.kv,
                             sent.last.num_cached_tokens, sent.kv_bytes, landed - sent.started,
                             sent.last)

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

    async def abort(self, request_id: str) -> None:
        def end(engine: LLMEngine) -> None:
            # Past its prefill a request is held, its stream over: it ends by release (the
            # engine has no stream left to abort). Else abort it; the command runs right
            # after this one, before any step could make it held.
            if request_id in engine.scheduler.holding:
                engine.release(request_id)
            else:
                self.loop.abort(request_id)
        if self.handoff is not None:
            self.handoff.abort(request_id)
        await self.loop.call(end)

    async def keepalive(self, sub: str) -> None:
        """Renew `sub`'s lease (actors/subscribers.py)."""
        self.subscribers.renew(sub)

    def _subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: abort the prefills it left here."""
        for request_id in request_ids:
            asyncio.ensure_future(self.abort(request_id))

    async def add_peer(self, descriptor: bytes) -> None:
        """Connect to a decode engine that joined after us (a restarted replica)."""
        await self.end.connect(descriptor)

    async def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """The engine's load report (see KVEndpoint.load, EngineLoop.load)."""
        return self.end.load(prefix_since)

    async def stage_times(self) -> list[tuple[str, float, float, float, float]]:
        """(request id, called, prefilled, handover started, KV in place) of recent requests."""
        return list(self.stages)

    async def diagnostics(self, since: float | None = None) -> dict:
        """The pump's command lag and slow iterations, and the engine's step durations; with
        `since` (monotonic), also the raw step log (began, ended, waiting, running) of the
        steps that began after it and the Triton kernels compiled since."""
        log = list(self.loop.step_log)
        out = {"pump": self.end.pump.stats(), "steps": len(log),
               **ms_percentiles("step", [b - a for a, b, *_ in log])}
        if since is not None:
            out["step_log"] = [row for row in log if row[0] >= since]
            out["kernel_compiles"] = compiles.since(since)
        return out

    async def timeline(self) -> list[tuple[str, int, float]]:
        """Per-layer (\"computed\" | \"posted\", layer, time) marks of a layer-wise handover
        (push); empty for the pool handoff."""
        return opened(self.handoff).timeline()
