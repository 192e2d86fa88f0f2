"""What request tracing (router/tracing.py) costs the router in-process, per request: the
hooks with tracing off, and building a traced disaggregated request's spans with it on.
bench/router_overhead.py --tracing-ab puts these figures beside its HTTP on/off comparison,
where the engines' time swamps them. Plain functions; nothing outlives a call.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

from router.app_sections import TracingConfig
from router.tracing import CURRENT, ROUTER, Tracing, _ns, traced


def off_path_us(n: int = 20000) -> dict[str, float]:
    """What tracing costs a request in this process, microseconds, best of three: off, `traced` around the handler's coroutine and the P/D
    client's one CURRENT lookup against awaiting the coroutine bare; on, a request's trace
    begun, given the eleven spans of a disaggregated request and finished (built and handed
    to the span file's batch; the export itself runs on the processor's thread)."""
    async def body() -> dict:
        return {}

    async def bare() -> None:
        for _ in range(n):
            await body()

    async def hooked() -> None:
        for _ in range(n):
            await traced(None, "text_completion", "m", None, body())
            CURRENT.get()

    def best(run: Any, count: int) -> float:
        times = []
        for _ in range(3):
            began = time.perf_counter()
            asyncio.run(run())
            times.append(time.perf_counter() - began)
        return min(times) / count * 1e6

    with tempfile.TemporaryDirectory() as tmp:
        tracing = Tracing(TracingConfig(enabled=True, file=f"{tmp}/spans.jsonl"), "bench")

        async def on() -> None:
            for _ in range(n // 20):
                trace = tracing.begin("text_completion", "m", None)
                now = time.monotonic()
                for name in ("router.route", "router.dispatch", "prefill", "prefill.queue",
                             "prefill.compute", "kv.transfer", "decode.landing",
                             "decode.queue", "decode"):
                    trace.add(name, _ns(now, trace.offset), _ns(now, trace.offset),
                              {"pd.process": ROUTER})
                trace.finish()
        traced_us = best(on, n // 20)
        tracing.shutdown()
    plain, off = best(bare, n), best(hooked, n)
    return {"bare_us": round(plain, 3), "off_us": round(off, 3),
            "off_cost_us": round(off - plain, 3), "on_us": round(traced_us, 1)}
