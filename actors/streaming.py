"""StreamingEngine: what every engine actor that decodes for the router has in common.

Lifecycle of a request on such an actor (ColocatedActor, EngineActor serving D):
    generate(id, ids, params, sub) → the request joins the engine (prefilled here); returns
                                     once queued, or raises RequestRejected
    outputs(sub)                   → one Ray streaming generator per subscriber (a router
                                     replica), opened once: batches of (id, StreamDelta |
                                     StreamError) of all its requests, one per engine step
                                     at most (actors/outbox.py)
    abort(id)                      → the engine aborts it and frees its blocks; its last
                                     delta says finish_reason "abort"
    keepalive(sub)                 → renews the subscriber's lease (actors/subscribers.py)
    the subscriber goes away       → its unfinished requests are aborted: when its stream
                                     closes, or at the latest when its lease expires
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import ray

from actors.engine_loop import EngineLoop
from actors.messages import STREAM_BACKPRESSURE, ReplicaLoad
from actors.outbox import Batch, Outbox
from actors.subscribers import Subscribers
from pd_cluster.sampling_params import SamplingParams


class StreamingEngine:
    loop: EngineLoop

    def _open_outbox(self) -> None:
        self.outbox = Outbox(on_gone=lambda ids: [self.loop.abort(rid) for rid in ids])
        self.subscribers = Subscribers(self._subscriber_gone)

    def _subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: end its streams (and what else it tracked here)."""
        self.outbox.close(sub)

    async def keepalive(self, sub: str) -> None:
        """Renew `sub`'s lease (actors/subscribers.py)."""
        self.subscribers.renew(sub)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       sub: str) -> None:
        """Start a request here (prefill and decode); its outputs go to `sub`'s stream."""
        self.subscribers.renew(sub)
        self.loop.submit(request_id, prompt_ids, params, self.outbox.queue(sub, request_id))

    @ray.method(_generator_backpressure_num_objects=STREAM_BACKPRESSURE)
    async def outputs(self, sub: str) -> AsyncIterator[Batch]:
        """Every output of `sub`'s requests, batched (Ray streaming generator)."""
        async for batch in self.outbox.stream(sub):
            yield batch

    async def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    async def run_offline(self, prompts: list[list[int]], params: SamplingParams,
                          concurrency: int) -> dict:
        """A benchmark's workload run here, with no HTTP, router or Ray stream
        (bench/served_vs_offline.py): a closed loop of `concurrency` consumers of
        `self.loop.stream`, each starting the next prompt when its request finishes.
        Returns output tokens, wall seconds from the first submit to the last finish, and
        per finished request its TTFT (submit → first output carrying tokens), the gaps
        between its successive outputs (one output carries several tokens when its consumer
        fell behind) and its tokens; failed requests are counted, with their errors.
        Cancelling the call aborts what still runs (the streams' own cleanup)."""
        import asyncio
        import time
        import uuid

        tag, todo = uuid.uuid4().hex[:8], iter(enumerate(prompts))
        records: list[dict] = []
        errors: list[str] = []

        async def consume() -> None:
            for i, ids in todo:         # one iterator shared by all consumers
                sent = time.perf_counter()
                first, last, gaps, tokens = None, sent, [], 0
                try:
                    async for out in self.loop.stream(f"offline-{tag}-{i}", ids, params):
                        if out.error:
                            raise RuntimeError(out.error)
                        if out.delta_token_ids:
                            now = time.perf_counter()
                            if first is None:
                                first = now - sent
                            else:
                                gaps.append(now - last)
                            last, tokens = now, tokens + len(out.delta_token_ids)
                except Exception as e:  # noqa: BLE001 - counted and reported, not hidden
                    errors.append(f"{type(e).__name__}: {e}"[:300])
                    continue
                records.append({"ttft": first, "gaps": gaps, "tokens": tokens,
                                "e2e": last - sent})

        start = time.perf_counter()
        await asyncio.gather(*[consume() for _ in range(max(1, min(concurrency, len(prompts))))])
        return {"requests": len(prompts), "completed": len(records), "failed": len(errors),
                "errors": errors[:10], "seconds": time.perf_counter() - start,
                "output_tokens": sum(r["tokens"] for r in records), "records": records}

    async def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """The engine's latest load report, with its prefix cache's changes after
        `prefix_since` when given (see EngineLoop.load)."""
        return self.loop.load(prefix_since)
