"""Request traces (router/tracing.py) and per-transfer metrics (router/transfer_metrics.py),
issue 48: the real `serve run configs/pd.yaml` (disaggregated, 1 P + 1 D, NIXL on the CPU)
with `tracing:` on, exporting over the real OTLP/HTTP exporter to a collector in this test
(a tiny HTTP server decoding the protobuf export) and to a span file, which `pd-cluster
trace` turns into Perfetto's JSON. One serve app checks everything at once: it costs most of
a minute to start on 2 cores. The quick tests below it: the dashboard's transfer panels
against the exported metric names, the transfer labels' bounds, the trace JSON of a file.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd_cluster.cli import main as cli_main
from pd_cluster.trace_events import trace_events
from router.transfer_metrics import MAX_PAIR_REPLICAS, TransferMetrics, cause_of, pair
from tests.support import REPO
from tests.support.serve_run import metrics_of, serve_run
from tests.support.waiting import wait_until

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


@pytest.fixture(scope="module")
def traced_server(own_ray):
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="pdtrace"))
    spans_file = work / "spans.jsonl"
    tracing = {"enabled": True, "endpoint": collector.url, "file": str(spans_file),
               "sampling_ratio": 1.0, "service_name": "pd-test"}
    try:
        with serve_run({"tracing": tracing}) as url:
            yield url, collector, spans_file
    finally:
        collector.shutdown()


def _request(url: str, path: str, body: dict, flags: str | None = "01"
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


def _check_trace(spans: list[dict], client_span: str, usage: dict, latency: float) -> dict:
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


@pytest.mark.serve
@pytest.mark.timeout(900)
def test_one_trace_per_request(traced_server, tmp_path):
    url, collector, spans_file = traced_server
    plain = _request(url, "/v1/completions", {
        "model": "default", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    grammar = _request(url, "/v1/chat/completions", {     # streamed: the SSE path's trace
        "model": "default", "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": SCHEMA}}})
    short = {"model": "default", "prompt": "Hello", "max_tokens": 2}
    unsampled = _request(url, "/v1/completions", short, flags="00")   # the client's choice
    untraced = _request(url, "/v1/completions", short, flags=None)    # sampling_ratio 1
    # + grammar.compile in the router, on P and on D (each builds its own matcher)
    wanted = {plain[0]: len(CHAIN) + len(P_STAGES), grammar[0]: len(CHAIN) + len(P_STAGES) + 3}

    def spans_of(trace_id: str) -> list[dict]:
        with collector.lock:
            return [s for s in collector.spans if s["trace_id"] == trace_id]
    wait_until(lambda: all(len(spans_of(t)) >= n + 1 for t, n in wanted.items()),
               SPANS_WITHIN_S, 0.2, "every span of both traces at the collector")

    def roots_of(response_id: str) -> list[dict]:
        with collector.lock:
            return [s for s in collector.spans if s["parent_id"] is None
                    and s["attrs"].get("gen_ai.response.id") == response_id]
    wait_until(lambda: roots_of(untraced[2]["id"]), SPANS_WITHIN_S, 0.2, "a trace of its own")
    assert len(roots_of(untraced[2]["id"])) == 1
    assert not spans_of(unsampled[0])       # exported with those, had it been sampled
    figures = {}
    for (trace_id, client_span, body, latency) in (plain, grammar):
        figures[trace_id] = _check_trace(spans_of(trace_id), client_span, body["usage"],
                                         latency)
    spans = spans_of(grammar[0])
    compiles = {s["attrs"]["pd.process"]: s for s in spans if s["name"] == "grammar.compile"}
    parents = {s["name"]: s["span_id"] for s in spans
               if s["name"] in ("router.preprocess", "prefill")}
    root = next(s for s in spans if s["parent_id"] == grammar[1])
    assert set(compiles) == {"router", "prefill-0", "decode-0"}
    assert compiles["router"]["parent_id"] == parents["router.preprocess"]
    assert compiles["prefill-0"]["parent_id"] == parents["prefill"]
    assert compiles["decode-0"]["parent_id"] == root["span_id"]
    print("trace figures:", json.dumps(figures))

    # Per-transfer metrics: both requests' handovers, labelled by transport and pair.
    m = metrics_of(url)
    counts = {tuple(sorted(s.labels.items())): s.value
              for s in m["pd_kv_transfer_duration_seconds"] if s.name.endswith("_count")}
    assert counts[(("pair", "p0-d0"), ("transport", "nixl"))] >= 2, counts
    assert "pd_kv_transfer_size_bytes" in m and "pd_kv_transfer_failures" in m

    # The span file holds the same spans; `pd-cluster trace` makes Perfetto's JSON of them.
    wait_until(lambda: spans_file.exists() and plain[0] in spans_file.read_text(),
               SPANS_WITHIN_S, 0.2, "the span file")
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(spans_file), "-o", str(out), "--trace-id", plain[0]]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= set(CHAIN + P_STAGES)
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {"router", "prefill-0", "decode-0"}
    png = os.environ.get("PD_TRACE_PNG")     # docs/: `PD_TRACE_PNG=docs/trace.png pytest ...`
    if png:
        from pd_cluster.trace_events import load_spans, render_png
        render_png(load_spans(spans_file), png, grammar[0])


# -- quick ---------------------------------------------------------------------------------

def test_dashboard_transfer_panels_query_the_exported_metrics():
    dashboard = json.loads((REPO / "helm" / "dashboards" / "pd-cluster.json").read_text())
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    panels = [p for p in dashboard["panels"] if p["title"].startswith("KV transfer")
              and p["id"] != 7]
    assert len(panels) == 4 and all(p["targets"] for p in panels)
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)
    metrics.observe("nixl", 0, 1, 1 << 20, 0.01)
    metrics.fail("nixl", 0, 1, TimeoutError("timed out"))
    names = {line.split("{")[0].split(" ")[0] for line in
             generate_latest(registry).decode().splitlines() if line and line[0] != "#"}
    for p in panels:
        for t in p["targets"]:
            (pattern,) = re.findall(r'__name__=~"([^"]+)"', t["expr"])
            assert any(re.fullmatch(pattern, n) for n in names), t["expr"]
            assert any(re.fullmatch(pattern, f"ray_{n}") for n in names), t["expr"]


def test_transfer_labels_stay_bounded():
    assert pair(0, 3) == "p0-d3" and pair(None, 3) == "other"
    assert pair(MAX_PAIR_REPLICAS, 0) == "other"
    assert cause_of(RuntimeError("request x: reservation expired")) == "expired"
    assert cause_of(TimeoutError()) == "timeout"
    assert cause_of(RuntimeError("q0: the decode replica had no room to reserve KV")) == "no_room"
    assert cause_of(RuntimeError("disk on fire")) == "error"


def test_trace_events_put_each_process_on_its_own_lane():
    def span(name, sid, parent, start, end, process):
        return {"trace_id": "ab" * 16, "span_id": sid, "parent_id": parent, "name": name,
                "start_ns": start, "end_ns": end, "attributes": {"pd.process": process}}
    spans = [span("chat m", "1", None, 0, 10_000_000, "router"),
             span("prefill", "2", "1", 1_000_000, 5_000_000, "prefill-0"),
             span("decode", "3", "1", 5_000_000, 9_000_000, "decode-0")]
    events = trace_events(spans)["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert list(lanes) == ["router", "prefill-0", "decode-0"]
    prefill = next(e for e in events if e["name"] == "prefill")
    assert (prefill["ts"], prefill["dur"], prefill["tid"]) == (1000.0, 4000.0, 2)
