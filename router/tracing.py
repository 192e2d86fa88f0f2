"""Request traces (issue 48): one OpenTelemetry trace per HTTP request, where its time went.

Spans are built in the router, once the request is over, from stamps: the router's own and
those the engine actors already take and return with their answers (P's PrefillTimes in its
PrefillResult, D's DecodeTimes from D.decode, D's engine stamps on its stream's last delta;
actors/messages.py). No trace context travels to the actors and they make no span: their
stamps are monotonic on their host and come with that host's wall-clock offset, so spans of
P's and D's work land on the router's timeline (exact on one node, NTP-close across nodes).

Lifecycle:
    router replica start  Tracing.start(config.tracing) -> None when off: every hook below is
                          then one `is None` test per request and nothing per token
    request arrives       `traced(...)` begins a RequestTrace (the root span, parented to the
                          client's W3C traceparent; the sampler may drop it -> None) and puts
                          it in CURRENT for the handler's task
    while it runs         hooks record stamps: serving's route (`JobTrace.routed`), the P/D
                          client's prefill / landing / decode / migration, the grammar check
                          (`stage`)
    request ends          `finish` builds every child span with its recorded times under the
                          root and ends the root; a BatchSpanProcessor exports them (OTLP/HTTP
                          and / or the span file, SpanFile) within EXPORT_EVERY_MS
    replica exit          the provider's atexit flush
Span tree of a disaggregated request (attribute `pd.process`: router | prefill-N | decode-N):
    {operation} {model} (root: gen_ai.* attributes) ─┬ router.preprocess ─ grammar.compile
                                                     ├ router.route, router.dispatch
                                                     ├ prefill ─ prefill.queue, prefill.compute,
                                                     │           kv.transfer, grammar.compile
                                                     ├ decode.landing, decode.queue, decode,
                                                     │ grammar.compile (D's own matcher)
                                                     └ migration (D died; the next attempt's
                                                       spans follow)
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from router.app_sections import TracingConfig

log = logging.getLogger(__name__)
EXPORT_EVERY_MS = 1000      # how long a finished span may wait in the batch before export
CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pd_request_trace", default=None)
ROUTER = "router"


def _ns(t: float, offset: float) -> int:
    """A monotonic stamp (seconds) on a host whose wall clock is monotonic + `offset`, as
    OpenTelemetry's epoch nanoseconds."""
    return int((t + offset) * 1e9)


class Tracing:
    """One router replica's tracer: its provider, sampler and exporters."""

    def __init__(self, config: TracingConfig, instance: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        # Our own provider, not the global one: Ray or user code may set that.
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name,
                                      "service.instance.id": instance}),
            sampler=ParentBased(TraceIdRatioBased(config.sampling_ratio)))
        if config.endpoint is not None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as e:
                raise ValueError("tracing.endpoint needs the OTLP/HTTP exporter: pip install "
                                 "'pd-cluster[tracing]'") from e
            self.provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=config.endpoint), schedule_delay_millis=EXPORT_EVERY_MS))
        if config.file is not None:
            self.provider.add_span_processor(BatchSpanProcessor(
                SpanFile(config.file), schedule_delay_millis=EXPORT_EVERY_MS))
        self.tracer = self.provider.get_tracer("pd_cluster.router")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, config: TracingConfig, instance: str) -> Tracing | None:
        """The replica's tracing, or None when off (then nothing else here ever runs)."""
        return cls(config, instance) if config.enabled else None

    def begin(self, operation: str, model: str, headers: Mapping[str, str] | None
              ) -> RequestTrace | None:
        """A request's trace, child of the client's traceparent if it sent one; None when
        the sampler drops it."""
        trace = RequestTrace(self, operation, model, self.propagator.extract(headers or {}))
        return trace if trace.root.is_recording() else None

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """One request's root span and the stamps of its stages until `finish`."""

    def __init__(self, tracing: Tracing, operation: str, model: str, parent: Any) -> None:
        from opentelemetry.trace import SpanKind

        self.tracing = tracing
        self.offset = time.time() - time.monotonic()    # the router's wall-clock offset
        self.started = time.monotonic()
        self.root = tracing.tracer.start_span(
            f"{operation} {model}", context=parent, kind=SpanKind.SERVER,
            start_time=_ns(self.started, self.offset),
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                        "gen_ai.provider.name": "pd-cluster", "pd.process": ROUTER})
        # (key, parent key or None: the root, name, start ns, end ns, attributes, error)
        self.records: list[tuple] = []
        self.jobs: dict[str, JobTrace] = {}
        self.routed_at: float | None = None

    def job(self, request_id: str) -> JobTrace:
        """The stages of one engine request (a choice of one prompt)."""
        job = self.jobs.get(request_id)
        if job is None:
            job = self.jobs[request_id] = JobTrace(self, request_id)
        return job

    def add(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any],
            parent: str | None = None, key: str | None = None, error: str | None = None
            ) -> None:
        """A span to build at `finish`; `parent`: an earlier record's key (None: the root)."""
        self.records.append((key, parent, name, start_ns, end_ns, attributes, error))

    def router_stage(self, name: str, start: float, end: float, **attributes: Any) -> None:
        """A stage of the router's own (monotonic stamps) under router.preprocess."""
        self.add(name, _ns(start, self.offset), _ns(end, self.offset),
                 {"pd.process": ROUTER, **attributes}, parent="preprocess")

    def request(self, **attributes: Any) -> None:
        """Attributes of the root span (gen_ai.request.*, gen_ai.response.id)."""
        self.root.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def finish(self, error: BaseException | None = None) -> None:
        """Build the recorded spans and end the root (now)."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        end = time.monotonic()
        routed = self.routed_at if self.routed_at is not None else end
        spans = {None: self.root}
        todo = [("preprocess", None, "router.preprocess", _ns(self.started, self.offset),
                 _ns(routed, self.offset), {"pd.process": ROUTER}, None), *self.records]
        for key, parent, name, start, stop, attributes, failed in todo:
            span = self.tracing.tracer.start_span(
                name, context=set_span_in_context(spans.get(parent, self.root)),
                start_time=start, attributes=attributes)
            if failed:
                span.set_status(Status(StatusCode.ERROR, failed))
            span.end(end_time=max(start, stop))
            if key is not None:
                spans[key] = span
        self.root.set_attributes(self._usage())
        if error is not None:
            self.root.set_status(Status(StatusCode.ERROR, repr(error)[:300]))
            self.root.set_attribute("error.type", type(error).__name__)
        self.root.end(end_time=_ns(end, self.offset))

    def _usage(self) -> dict[str, Any]:
        done = [job.usage for job in self.jobs.values() if job.usage is not None]
        if not done:
            return {}
        prompts = {index: tokens for index, tokens, *_ in done}   # a prompt's n choices: once
        return {"gen_ai.usage.input_tokens": sum(prompts.values()),
                "gen_ai.usage.output_tokens": sum(u[2] for u in done),
                "gen_ai.response.finish_reasons": [str(u[3]) for u in done]}


class JobTrace:
    """Stamps of one engine request: route, each prefill attempt, D's landing, queue and
    decode, migrations. Methods take monotonic stamps of the router unless they say."""

    def __init__(self, trace: RequestTrace, request_id: str) -> None:
        self.trace, self.request_id = trace, request_id
        self.landed: tuple[int, float] | None = None     # (ns, D's offset) of the last landing
        self.dispatched: float | None = None    # this attempt began: D's stream, reservation
        # (prompt index, its tokens, output tokens, finish reason) once it is done
        self.usage: tuple[int, int, int, Any] | None = None
        self._n = 0

    def _key(self, what: str) -> str:
        self._n += 1
        return f"{self.request_id}/{what}/{self._n}"

    def routed(self, start: float, end: float, prefill_id: int | None, decode_id: int) -> None:
        trace = self.trace
        if trace.routed_at is None:
            trace.routed_at = start
        trace.add("router.route", _ns(start, trace.offset), _ns(end, trace.offset),
                  {"pd.process": ROUTER, "pd.request_id": self.request_id,
                   "pd.route.prefill": -1 if prefill_id is None else prefill_id,
                   "pd.route.decode": decode_id})

    def dispatching(self, began: float) -> None:
        """An attempt begins: until P's call, the router opens D's stream and asks D to
        reserve the prompt's blocks (router.dispatch)."""
        self.dispatched = began

    def prefill(self, p_id: int, d_id: int, called: float, answered: float, result: Any,
                error: BaseException | None = None) -> None:
        """P's prefill call as the router made it, with P's own stages (`result.times`,
        actors.messages.PrefillTimes) inside: its queue, its compute, the KV transfer."""
        trace, key, process = self.trace, self._key("prefill"), f"prefill-{p_id}"
        if self.dispatched is not None:
            trace.add("router.dispatch", _ns(self.dispatched, trace.offset),
                      _ns(called, trace.offset), {"pd.process": ROUTER})
            self.dispatched = None
        trace.add("prefill", _ns(called, trace.offset), _ns(answered, trace.offset),
                  {"pd.process": process, "pd.request_id": self.request_id}, key=key,
                  error=None if error is None else str(error).strip()[-300:] or repr(error))
        t = getattr(result, "times", None)
        if t is None:
            return
        o, own = t.wall_offset, {"pd.process": process}
        scheduled = t.scheduled if t.scheduled is not None else t.called
        trace.add("prefill.queue", _ns(t.called, o), _ns(scheduled, o), own, key)
        if t.grammar is not None:   # P's engine built the request's grammar matcher
            trace.add("grammar.compile", _ns(t.grammar[0], o), _ns(t.grammar[1], o), own, key)
        trace.add("prefill.compute", _ns(scheduled, o), _ns(t.prefilled, o), own, key)
        seconds = max(t.landed - t.started, 1e-9)
        trace.add("kv.transfer", _ns(t.started, o), _ns(t.landed, o), {
            **own, "pd.kv_transfer.bytes": result.kv_bytes,
            "pd.kv_transfer.gbps": round(result.kv_bytes / seconds / 1e9, 3),
            "pd.kv_transfer.transport": t.transport, "pd.kv_transfer.layers": t.layers,
            "pd.kv_transfer.peer": f"prefill-{p_id}->decode-{d_id}"}, key)

    def landing(self, d_id: int, times: Any) -> None:
        """D took the KV over (actors.messages.DecodeTimes, D's clock)."""
        o = times.wall_offset
        self.trace.add("decode.landing", _ns(times.called, o), _ns(times.landed, o),
                       {"pd.process": f"decode-{d_id}"})
        self.landed = (_ns(times.landed, o), o)

    def decoded(self, d_id: int, engine_times: tuple | None, received: float) -> None:
        """D's last output is in (`received`): its queue and decode from D's engine stamps
        (arrival, scheduled, first token, done). After a landing, D's queue runs from it to
        D's engine resuming the request; when D prefilled the prompt itself, from its
        arrival through its queue and prefill."""
        trace, process = self.trace, {"pd.process": f"decode-{d_id}"}
        if engine_times is None or engine_times[2] is None:
            return
        arrival, scheduled, first, _, grammar = engine_times
        if self.landed is not None:
            landed, o = self.landed
            trace.add("decode.queue", landed, max(landed, _ns(first, o)), process)
        else:   # local prefill on D: D's clock is taken to be the router's (one node)
            o = trace.offset
        if grammar is not None:     # D's engine built its own matcher (at its reservation)
            trace.add("grammar.compile", _ns(arrival, o), _ns(grammar, o), process)
        if self.landed is None:
            scheduled = scheduled if scheduled is not None else arrival
            trace.add("decode.queue", _ns(arrival, o), _ns(scheduled, o), process)
            trace.add("decode.prefill", _ns(scheduled, o), _ns(first, o), process)
        trace.add("decode", _ns(first, o), _ns(received, trace.offset), process)
        self.landed = None

    async def watch(self, deltas: AsyncIterator[Any], d_id: int) -> AsyncIterator[Any]:
        """D's stream of StreamDeltas as it comes; its last one's engine stamps recorded
        (`decoded`) when it arrives."""
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                if delta.finished:
                    self.decoded(d_id, delta.engine_times, time.monotonic())
                yield delta

    def migrated(self, from_d: int, to_d: int, detected: float, tokens: int) -> None:
        trace = self.trace
        trace.add("migration", _ns(detected, trace.offset), _ns(time.monotonic(), trace.offset),
                  {"pd.process": ROUTER, "pd.migration.from": f"decode-{from_d}",
                   "pd.migration.to": f"decode-{to_d}", "pd.migration.tokens_streamed": tokens})
        self.landed = None

    def done(self, prompt_index: int, prompt_tokens: int, output_tokens: int,
             finish_reason: Any) -> None:
        self.usage = (prompt_index, prompt_tokens, output_tokens, finish_reason)


def stage(name: str, start: float, end: float, **attributes: Any) -> None:
    """A router stage of the current request's trace, if it has one (monotonic stamps)."""
    trace = CURRENT.get()
    if trace is not None:
        trace.router_stage(name, start, end, **attributes)


async def traced(tracing: Tracing | None, operation: str, model: str,
                 headers: Mapping[str, str] | None, body: Awaitable[Any]) -> Any:
    """`await body` (the handler's work: a JSON body, or an async iterator of SSE events),
    traced as one request when tracing is on and the sampler keeps it."""
    if tracing is None:
        return await body
    trace = tracing.begin(operation, model, headers)
    # Set in the handler's task, which ends with the request: the engine client's streams,
    # started from it, see it (a task copies its context when created).
    CURRENT.set(trace)
    if trace is None:           # not sampled
        return await body
    try:
        result = await body
    except BaseException as e:
        _finish(trace, e)
        raise
    if isinstance(result, dict):
        _finish(trace)
        return result
    return _finishing(trace, result)


async def _finishing(trace: RequestTrace, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE events; the trace ends after the last one (or with the error that ends them,
    the client going away included). Closing this closes `events`, which aborts the request's
    engine requests (router/serving.py)."""
    error = None
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except BaseException as e:
        error = e
        raise
    finally:
        _finish(trace, error)


def _finish(trace: RequestTrace, error: BaseException | None = None) -> None:
    """End the trace; a failure of tracing is logged, never the request's."""
    try:
        trace.finish(error)
    except Exception:
        log.exception("could not finish the trace of a request")


class SpanFile:
    """A SpanExporter appending each finished span as one JSON object a line, for
    `pd-cluster trace` (pd_cluster/trace_events.py) to turn into Perfetto's JSON."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for s in spans:
            ctx, parent = s.get_span_context(), s.parent
            lines.append(json.dumps({
                "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                "parent_id": None if parent is None else f"{parent.span_id:016x}",
                "name": s.name, "start_ns": s.start_time, "end_ns": s.end_time,
                "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
                "service": s.resource.attributes.get("service.name")}, default=str))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

