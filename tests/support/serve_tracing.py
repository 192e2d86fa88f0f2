"""The served half of the tracing tests (router/tracing.py, issue 48): an OTLP/HTTP traces
endpoint in the test process (a tiny HTTP server decoding the protobuf export) that a `serve run`
application's `tracing:` exports to, beside a span file; requests with a W3C traceparent; and
the check of one request's spans (the tree across processes, the attributes, the durations).
tests/router/control/test_control_plane.py runs them on its server."""
from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

# The stages of a disaggregated request that follow each other, router to D: their
# durations add up to the root span's (the request in the router).
CHAIN = ("router.preprocess", "router.route", "router.dispatch", "prefill", "decode.landing",
         "decode.queue", "decode")
P_STAGES = ("prefill.queue", "prefill.compute", "kv.transfer")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SPANS_WITHIN_S = 30.0       # the exporter's batch goes out every second


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint: every span of every export, decoded."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def spans_of(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def roots_of(self, response_id: str) -> list[dict]:
        """The root spans of the traces the server began itself for this response."""
        with self.lock:
            return [s for s in self.spans if s["parent_id"] is None
                    and s["attrs"].get("gen_ai.response.id") == response_id]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        spans = [_decoded(span, rs.resource) for rs in export.resource_spans
                 for ss in rs.scope_spans for span in ss.spans]
        with self.server.lock:
            self.server.spans.extend(spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return [_value(x) for x in v.array_value.values] if kind == "array_value" \
        else getattr(v, kind)


def _decoded(span, resource) -> dict:
    return {"trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
            "parent_id": span.parent_span_id.hex() or None, "name": span.name,
            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
            "attrs": {a.key: _value(a.value) for a in span.attributes},
            "service": {a.key: _value(a.value) for a in resource.attributes}
            .get("service.name")}


@contextlib.contextmanager
def collecting(service_name: str) -> Iterator[tuple[Collector, Path, dict]]:
    """A running Collector, the span file's path, and the application's `tracing` args that
    export every request's spans to both; all stopped and removed afterwards."""
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="pdtrace"))
    spans_file = work / "spans.jsonl"
    tracing = {"enabled": True, "endpoint": collector.url, "file": str(spans_file),
               "sampling_ratio": 1.0, "service_name": service_name}
    try:
        yield collector, spans_file, tracing
    finally:
        collector.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def traced_request(url: str, path: str, body: dict, flags: str | None = "01"
             ) -> tuple[str, str, dict, float]:
    """(trace id, client span id, the response body, latency in s) of one request with a
    traceparent (its trace flags `flags`; None: no traceparent)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    began = time.perf_counter()
    r = httpx.post(f"{url}{path}", json=body, timeout=120, headers={} if flags is None else
                   {"traceparent": f"00-{trace_id}-{span_id}-{flags}"})
    latency = time.perf_counter() - began
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return trace_id, span_id, r.json(), latency
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    return trace_id, span_id, next(e for e in events if e.get("usage")), latency


def check_trace(spans: list[dict], client_span: str, usage: dict, latency: float) -> dict:
    """One request's spans: the tree, the processes, the attributes, the durations."""
    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    roots = [s for s in spans if s["parent_id"] == client_span]
    assert len(roots) == 1, [s["name"] for s in roots]
    root = roots[0]
    missing = set(CHAIN + P_STAGES) - by_name.keys()
    assert not missing, f"missing spans {missing} in {sorted(by_name)}"
    one = {name: by_name[name][0] for name in CHAIN + P_STAGES}
    assert all(len(by_name[n]) == 1 for n in CHAIN + P_STAGES), by_name.keys()
    # Parent links across processes: router -> P's call -> P's stages; D's stages under
    # the request.
    for name in CHAIN:
        assert one[name]["parent_id"] == root["span_id"], name
    for name in P_STAGES:
        assert one[name]["parent_id"] == one["prefill"]["span_id"], name
        assert one[name]["attrs"]["pd.process"] == "prefill-0"
    for name in ("decode.landing", "decode.queue", "decode"):
        assert one[name]["attrs"]["pd.process"] == "decode-0"
    assert root["attrs"]["pd.process"] == "router" and root["service"] == "pd-test"
    # GenAI semantic conventions on the root.
    a = root["attrs"]
    assert a["gen_ai.request.model"] == "default"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    kv = one["kv.transfer"]["attrs"]
    assert kv["pd.kv_transfer.bytes"] > 0 and kv["pd.kv_transfer.gbps"] > 0
    assert kv["pd.kv_transfer.transport"] == "nixl" and kv["pd.kv_transfer.layers"] == 30
    # Each stage within its parent; the chain's durations add up to the request's.
    for name in P_STAGES:
        assert one["prefill"]["start"] <= one[name]["start"] <= one[name]["end"] \
            <= one["prefill"]["end"], name
    for s in spans:
        assert root["start"] <= s["start"] <= s["end"] <= root["end"], s["name"]
    total = (root["end"] - root["start"]) / 1e9
    chain = sum(one[n]["end"] - one[n]["start"] for n in CHAIN) / 1e9
    assert abs(chain / total - 1) < 0.05, (chain, total)
    assert total <= latency
    return {"root_ms": round(total * 1e3, 1), "chain_ms": round(chain * 1e3, 1),
            "client_ms": round(latency * 1e3, 1)}


def metrics_by_router(url: str, routers: int, tries: int = 40) -> dict[str, dict]:
    """Each router replica's own /metrics (the ingress spreads the scrapes), parsed: a router
    counts what it served only."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        r = httpx.get(f"{url}/metrics", timeout=30)
        seen[r.headers["x-pd-router"]] = {f.name: f.samples
                                          for f in text_string_to_metric_families(r.text)}
        if len(seen) == routers:
            break
    return seen
