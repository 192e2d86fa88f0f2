"""`pd-cluster trace`: request traces for people without a collector (issue 48).

The router's span file (`tracing.file` in configs/pd.yaml; router/tracing.py's SpanFile: one
JSON object a line, one line a finished span) is turned into Chrome's trace-event JSON, which
Perfetto (ui.perfetto.dev) and chrome://tracing open: one process per request (its trace),
one thread per lane, the process a span's work ran in (`pd.process`: router, prefill-N,
decode-N), each span a complete ("X") event whose args are its attributes and ids. With
`--png`, a timeline of the same spans drawn with matplotlib (the `bench` extra).

Lifecycle: read the file whole -> group spans by trace -> write the JSON (and the PNG); no
state. Plain JSON in and out: no Ray, no OpenTelemetry import.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

LANE_ORDER = ("router", "prefill", "decode")


def load_spans(path: str | Path) -> list[dict[str, Any]]:
    """The spans of a span file, in file order; a line that is not a span is an error."""
    spans = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            span = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{n}: not a JSON line") from None
        if not isinstance(span, dict) or \
                not {"trace_id", "span_id", "name", "start_ns", "end_ns"} <= span.keys():
            raise ValueError(f"{path}:{n}: not a span of router/tracing.py's SpanFile")
        spans.append(span)
    return spans


def by_trace(spans: list[dict[str, Any]], trace_id: str | None = None
             ) -> dict[str, list[dict[str, Any]]]:
    """Spans grouped by trace id (only `trace_id`'s when given), each trace in start order."""
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        if trace_id is None or s["trace_id"] == trace_id:
            traces[s["trace_id"]].append(s)
    if trace_id is not None and not traces:
        raise ValueError(f"no span of trace {trace_id} in the file")
    return {t: sorted(v, key=lambda s: (s["start_ns"], -s["end_ns"])) for t, v in traces.items()}


def _lane(span: dict[str, Any]) -> str:
    return str(span.get("attributes", {}).get("pd.process", "router"))


def _lane_key(lane: str) -> tuple[int, str]:
    kind = lane.split("-", 1)[0]
    return (LANE_ORDER.index(kind) if kind in LANE_ORDER else len(LANE_ORDER), lane)


def _root(trace: list[dict[str, Any]]) -> dict[str, Any]:
    ids = {s["span_id"] for s in trace}
    roots = [s for s in trace if s.get("parent_id") not in ids]
    return min(roots or trace, key=lambda s: s["start_ns"])


def trace_events(spans: list[dict[str, Any]], trace_id: str | None = None) -> dict[str, Any]:
    """Chrome's trace-event JSON object of the spans (one request's with `trace_id`)."""
    traces = by_trace(spans, trace_id)
    origin = min((s["start_ns"] for t in traces.values() for s in t), default=0)
    events: list[dict[str, Any]] = []
    for pid, (tid_hex, trace) in enumerate(sorted(traces.items(),
                                                  key=lambda kv: kv[1][0]["start_ns"]), 1):
        lanes = sorted({_lane(s) for s in trace}, key=_lane_key)
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"{_root(trace)['name']} (trace {tid_hex[:8]})"}})
        for tid, lane in enumerate(lanes, 1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": lane}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in trace:
            events.append({
                "ph": "X", "name": s["name"], "cat": _lane(s).split("-", 1)[0],
                "pid": pid, "tid": lanes.index(_lane(s)) + 1,
                "ts": (s["start_ns"] - origin) / 1e3, "dur": (s["end_ns"] - s["start_ns"]) / 1e3,
                "args": {**s.get("attributes", {}), "trace_id": s["trace_id"],
                         "span_id": s["span_id"], "parent_id": s.get("parent_id"),
                         "status": s.get("status")}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _depth_first(trace: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(depth, span) rows: each span after its parent, children in start order."""
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    ids = {s["span_id"] for s in trace}
    for s in trace:
        children[s.get("parent_id") if s.get("parent_id") in ids else None].append(s)
    rows: list[tuple[int, dict[str, Any]]] = []

    def visit(parent: str | None, depth: int) -> None:
        for s in children[parent]:
            rows.append((depth, s))
            visit(s["span_id"], depth + 1)
    visit(None, 0)
    return rows


def render_png(spans: list[dict[str, Any]], path: str | Path, trace_id: str | None = None,
               title: str | None = None) -> None:
    """A timeline of one trace (the first one in the file without `trace_id`): a bar per
    span, indented under its parent, coloured by the lane it ran in."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = by_trace(spans, trace_id)
    trace = min(traces.values(), key=lambda t: t[0]["start_ns"])
    rows = _depth_first(trace)
    origin = min(s["start_ns"] for s in trace)
    colours = {"router": "#4c72b0", "prefill": "#dd8452", "decode": "#55a868"}
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.4))
    for y, (depth, s) in enumerate(rows):
        start, dur = (s["start_ns"] - origin) / 1e6, (s["end_ns"] - s["start_ns"]) / 1e6
        ax.barh(y, max(dur, 0.05), left=start, height=0.6,
                color=colours.get(_lane(s).split("-", 1)[0], "#8c8c8c"))
        label = f"{'  ' * depth}{s['name']}  [{_lane(s)}]"
        ax.text(-0.01, y, label, transform=ax.get_yaxis_transform(), ha="right",
                va="center", fontsize=8, family="monospace")
        ax.text(start + max(dur, 0.05), y, f" {dur:.1f} ms", va="center", fontsize=7)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the request reached the router")
    ax.set_title(title or f"{_root(trace)['name']} - trace {trace[0]['trace_id']}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.33, right=0.95)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="turn the router's span file (tracing.file) into "
                       "Perfetto / Chrome trace JSON (and a PNG timeline)")
    p.add_argument("spans", help="the span file: tracing.file of configs/pd.yaml")
    p.add_argument("-o", "--output", default="trace.json", help="trace-event JSON to write")
    p.add_argument("--trace-id", default=None, help="only this request's trace (32 hex digits)")
    p.add_argument("--png", default=None, help="also draw one trace's timeline into this PNG")
    p.set_defaults(func=_trace)


def _trace(args: argparse.Namespace) -> int:
    spans = load_spans(args.spans)
    out = trace_events(spans, args.trace_id)
    Path(args.output).write_text(json.dumps(out), encoding="utf-8")
    spans_out = sum(e["ph"] == "X" for e in out["traceEvents"])
    traces = len({e["pid"] for e in out["traceEvents"]})
    print(f"{args.output}: {spans_out} spans of {traces} request(s); open it in "
          "https://ui.perfetto.dev or chrome://tracing")
    if args.png:
        render_png(spans, args.png, args.trace_id)
        print(f"{args.png}: the timeline of one request")
    return 0
