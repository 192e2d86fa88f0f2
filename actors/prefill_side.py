"""PrefillSide: an engine replica serving as P computes prompts' KV, hands it over to decode
engines (its KVSender, actors/handoff.py) and answers each prompt's first token. The
EngineActor (actors/engine_actor.py) owns the engine loop, its KVEndpoint and the subscriber
leases (what `PrefillHost` names); this is what it does with them while it serves P. (The
whole exchange of router, P and D: router/disagg_client.py.)

Lifecycle of a request:
    prefill(id, ids, params, destination)
                           → the sender's `send` runs the prefill and hands the KV over
    waiting → prefilling   → (chunked) prefill in the engine's continuous batch (push: after
                             each layer that layer's writes go out, overlapping the next layer)
    first token sampled    → the request holds its KV blocks (TRANSFERRING) while the handoff
                             finishes (push: every write landed in D's blocks; pool: the
                             prompt's blocks put into the pool, held for D)
    handed over → done     → blocks released (they stay in the prefix cache) and a
                             PrefillResult goes back to the caller: the first token as the
                             request's stream shows it (its one trip to the caller), and
                             where the KV is
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
from typing import Protocol, runtime_checkable

from actors.engine_loop import EngineLoop
from actors.handoff import KVEndpoint, KVHandoff, KVSender, opened
from actors.messages import PrefillResult, PrefillTimes, StreamDelta
from actors.subscribers import Subscribers
from pd_cluster.engine import LLMEngine
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import FinishReason
from pd_cluster.sampling_params import SamplingParams


@runtime_checkable
class PrefillHost(Protocol):
    """What PrefillSide uses of the engine actor that holds it (EngineActor)."""

    loop: EngineLoop                # runs the prefills
    end: KVEndpoint                 # the KV cache's transport: the sender's, and its counts
    subscribers: Subscribers        # the router replicas' leases on the prefills


class PrefillSide:
    """P's requests on `host`'s engine; `sender`: its part of the handoff, once opened."""

    def __init__(self, host: PrefillHost) -> None:
        self.host = host
        self.sender: KVSender | None = None
        self._releases: set[asyncio.Future] = set()
        # Recent requests' stage times (called, prefilled, handover started, KV in place),
        # for diagnosing where a TTFT goes under load (bench/harness/diagnostics.py).
        self.stages: collections.deque = collections.deque(maxlen=4096)

    @staticmethod
    def configure(engine: LLMEngine) -> None:
        """Engine thread: P steps synchronously (see the module docstring)."""
        engine.async_scheduling = False

    async def open(self, handoff: KVHandoff, peers: list[bytes]) -> None:
        """Hand prompts' KV over this way from now on (the controller opens the handoff)."""
        self.close()
        self.sender = await handoff.open_prefill(self.host.end, peers)

    def close(self) -> None:
        """No handoff any more (the engine changes roles) until `open` again."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      destination: list | None, sub: str | None = None) -> PrefillResult:
        """Prefill the prompt and hand its KV over (`destination`: what the router's handoff
        says of where it goes); returns the first token once the KV is in place. `sub`: the
        router replica it is for; its lease expiring aborts the prefill."""
        host, called = self.host, time.monotonic()
        host.subscribers.track(sub, request_id)
        try:
            sent = await opened(self.sender).send(
                request_id, prompt_ids, destination,
                lambda: self._first_output(request_id, prompt_ids, params), params.cache_salt)
        finally:
            host.subscribers.done(request_id)
            self._release(request_id)
        landed = time.monotonic()
        self.stages.append((request_id, called, sent.prefilled, sent.started, landed))
        host.end.count(sent.kv_bytes, landed - sent.started)
        times = sent.last.engine_times or (None,) * 5
        return PrefillResult(StreamDelta.first_token(sent.last), sent.kv, sent.kv_bytes,
                             landed - sent.started, PrefillTimes(
                                 called, times[1], sent.prefilled, sent.started, landed,
                                 time.time() - time.monotonic(), host.end.descriptor.backend,
                                 host.end.layout.num_layers,
                                 None if times[4] is None else (times[0], times[4])))

    async def _first_output(self, request_id: str, prompt_ids: list[int],
                            params: SamplingParams) -> RequestOutput:
        """Run the prefill; its last output (the first token's), its KV blocks held."""
        last = None
        async for out in self.host.loop.stream(request_id, prompt_ids, params, hold_kv=True):
            last = out
        if last is None or last.outputs[0].finish_reason is FinishReason.ABORT:
            raise RuntimeError(f"prefill of {request_id} was aborted")
        return last

    def _release(self, request_id: str) -> None:
        # Freeing the blocks need not delay the answer (nor TTFT): queue it and go on.
        self._releases.add(asyncio.ensure_future(
            self.host.loop.call(lambda e: e.release(request_id))))
        self._releases = {t for t in self._releases if not t.done()}

    async def abort(self, request_id: str) -> None:
        loop = self.host.loop

        def end(engine: LLMEngine) -> None:
            # Past its prefill a request is held, its stream over: it ends by release (the
            # engine has no stream left to abort). Else abort it; the command runs right
            # after this one, before any step could make it held.
            if request_id in engine.scheduler.holding:
                engine.release(request_id)
            else:
                loop.abort(request_id)
        if self.sender is not None:
            self.sender.abort(request_id)
        await loop.call(end)

    def subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: abort the prefills it left here."""
        for request_id in request_ids:
            asyncio.ensure_future(self.abort(request_id))

    def timeline(self) -> list[tuple[str, int, float]]:
        """Per-layer ("computed" | "posted", layer, time) marks of a layer-wise handover
        (push); empty for the pool handoff."""
        return opened(self.sender).timeline()
