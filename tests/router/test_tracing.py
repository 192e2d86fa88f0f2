"""Request traces (router/tracing.py) and per-transfer metrics (router/transfer_metrics.py),
issue 48, the quick tests: the dashboard's transfer panels against the exported metric names,
the transfer labels' bounds, the trace JSON of a file. The served test (the real `serve run
configs/pd.yaml` with `tracing:` on, one trace per request at a collector in the test and in a
span file, `pd-cluster trace` of it) runs on the control plane's server, which it shares to
save a server start: tests/router/control/test_control_plane.py::test_one_trace_per_request.
"""
from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry, generate_latest

from pd_cluster.trace_events import trace_events
from router.transfer_metrics import MAX_PAIR_REPLICAS, TransferMetrics, cause_of, pair
from tests.support import REPO


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
