"""Where a served request's time goes, from the engine actors' own stamps: the reductions
behind the serving benchmarks' diagnostics (`python -m bench.serving_sweep`). The stamps are
fetched from the actors by bench/serving_bench.py; everything here is plain data in, numbers
out.

- `ttft_parts_of`: each measured request's TTFT cut at the router's and the prefill actor's
  own stamps, joined by the server's response id (the attempt id is `<response id>-0`). Every
  stamp is CLOCK_MONOTONIC of one host: bench's `records_clock_origin` + `start` is the send.
- `replay`: the simulator run on the arrivals and lengths bench actually sent (warm-up and
  cool-down included), so that a prediction and a measurement share one trace and differ
  only by the model, not by which Poisson draw each of them got.
- `actor_stages`, `timeline`: stage percentiles (queue+prefill, destination, transfer,
  handoff, landing) and P's raw timeline of a run.
"""
from __future__ import annotations

from typing import Any

import numpy as np

PARTS = ("to_router", "to_prefill", "queue_prefill", "destination", "transfer", "back_to_router",
         "to_client")
PART_DEFINITIONS = {
    "to_router": "send -> the router's client is called: HTTP, ingress, parsing, tokenization",
    "to_prefill": "-> P's prefill call starts: D's reservation sent, the Ray call to P",
    "queue_prefill": "-> the first token is sampled on P: P's queue and its engine steps",
    "destination": "-> D's reservation known (0 when it came first)",
    "transfer": "-> the last KV write landed on D, as P sees it",
    "back_to_router": "-> P's answer is back in the router: P's reply through Ray",
    "to_client": "-> the first text at the client: the router's stream, ingress, SSE",
}


def ttft_parts_of(report: dict, measured: slice, router_stamps: list,
                  prefill_rows: list[list], diagnostics: list[dict]) -> dict:
    """Percentiles (ms) of each part of the measured requests' TTFT, their rows, and P's
    engine steps over the run: from bench's `report`, the router client's `stamps` and each
    prefill actor's `stage_times()` rows and `diagnostics(since)`."""
    p_stamps = {r[0]: r[1:] for actor_rows in prefill_rows for r in actor_rows}
    ms = join_parts(report["records"][measured], report.get("records_clock_origin"),
                    {r[0]: r[1:] for r in router_stamps}, p_stamps) * 1e3
    steps = [b - a for d in diagnostics for a, b, *_ in d.get("step_log", [])]
    return {"joined": len(ms), "of": len(report["records"][measured]),
            "definitions": PART_DEFINITIONS,
            "ms": {name: pcts(ms[:, k]) for k, name in enumerate(PARTS)},
            "rows_ms": np.round(ms, 2).tolist(),
            "prefill_steps_ms": {**pcts(np.array(steps) * 1e3), "n": len(steps)}}


def join_parts(records: list[dict], origin: float | None,
               router: dict[str, tuple[float, float]],
               prefill: dict[str, tuple[float, float, float, float]]) -> np.ndarray:
    """(requests x PARTS) seconds: bench's records joined by attempt id with the router's
    (client called, P's answer back) and P's (called, prefilled, destination known, KV
    landed) stamps; unmatched or failed ones left out."""
    parts = []
    for r in records:
        rid = f"{r.get('response_id', '')}-0"
        if origin is None or rid not in router or rid not in prefill or not r["ok"]:
            continue
        sent = origin + r["start"]
        entered, answered = router[rid]
        called, prefilled, dest, landed = prefill[rid]
        parts.append((entered - sent, called - entered, prefilled - called,
                      max(0.0, dest - prefilled), landed - max(dest, prefilled),
                      answered - landed, sent + r["ttft"] - answered))
    return np.array(parts).reshape(-1, len(PARTS))


def replay(profile: Any, limits: dict, num_prefill: int, num_decode: int, report: dict,
           measured: slice, rate: float, slo: Any) -> dict:
    """The simulator's TTFT/TPOT percentiles and goodput on bench's own arrivals and lengths."""
    from pd_cluster.tuning.simulator import (ClusterSpec, EngineLimits, Simulator,
                                             overhead_quantile)

    records = report["records"]
    arrivals = np.array([r["start"] for r in records])
    lengths = [(r["prompt_tokens"] or r["input_len"], r["output_tokens"] or r["output_len"])
               for r in records]
    result = Simulator(profile, EngineLimits(**limits), ClusterSpec(num_prefill, num_decode)) \
        .run(lengths, arrivals - arrivals.min(), rate, measured)
    q = slo.percentile
    # Its TTFT less the serving overhead: the part that P's queue_prefill (+ destination and
    # transfer) in ttft_parts measures.
    first = measured.start or 0
    engine = result.ttft - np.array([profile.overhead_time(i, overhead_quantile(first + k))
                                     for k, (i, _) in enumerate(lengths[measured])])
    return {"engine_ms": pcts(engine * 1e3),
            "ttft_p50": float(np.percentile(result.ttft, 50)),
            f"ttft_p{q:g}": float(np.percentile(result.ttft, q)),
            "tpot_p50": float(np.percentile(result.tpot, 50)),
            f"tpot_p{q:g}": float(np.percentile(result.tpot, q)),
            "slo_attainment": result.met_fraction(slo), "goodput": result.goodput(slo)}


def pcts(x: np.ndarray) -> dict:
    if not len(x):
        return {}
    p10, p50, p90 = np.percentile(x, [10, 50, 90])
    return {"mean": round(float(x.mean()), 2), "p10": round(float(p10), 2),
            "p50": round(float(p50), 2), "p90": round(float(p90), 2)}


def stage_stats(values: list[float]) -> dict:
    """n, p50, p90 and max (ms) of durations in seconds."""
    v = sorted(values)
    if not v:
        return {}
    return {"n": len(v), "p50_ms": round(v[len(v) // 2] * 1e3, 2),
            "p90_ms": round(v[int(0.9 * (len(v) - 1))] * 1e3, 2), "max_ms": round(v[-1] * 1e3, 2)}


def actor_stages(p_rows: list, d_rows: list, since: float) -> dict:
    """Stage percentiles of the requests P was called for after `since` (monotonic), from
    the actors' own stamps alone (no client-side send times): what a sweep through HTTP can
    see inside the engines."""
    d = {r[0]: r[1:] for r in d_rows}
    stages = {k: [] for k in ("queue_prefill", "destination", "transfer", "handoff", "landing")}
    for rid, called, prefilled, dest, landed in p_rows:
        if called < since:
            continue
        stages["queue_prefill"].append(prefilled - called)
        stages["destination"].append(max(0.0, dest - prefilled))
        stages["transfer"].append(landed - dest)
        if rid in d:
            stages["handoff"].append(d[rid][0] - landed)
            stages["landing"].append(d[rid][1] - d[rid][0])
    return {k: stage_stats(v) for k, v in stages.items()}


def timeline(p_rows: list, step_log: list, since: float, compiled: list = ()) -> dict:
    """P's raw timeline after `since`, in ms from it: each request's (called, prefilled, dest
    known, KV landed) and each engine step's (began, ended, waiting, running); plus the time P's
    engine sat between steps while a request it had been called for (2 ms earlier or more)
    was not yet prefilled: time lost between the actor and its engine thread; and the Triton
    kernels P compiled meanwhile (time, name)."""
    ms = lambda t: round((t - since) * 1e3, 1)  # noqa: E731
    reqs = [(ms(c), ms(p), ms(d), ms(k)) for _, c, p, d, k in p_rows if c >= since]
    steps = [(ms(a), ms(b), w, r) for a, b, w, r in step_log if a >= since]
    lost = []
    for prev, nxt in zip(steps, steps[1:]):
        stuck = [c for c, p, *_ in reqs if c < nxt[0] - 2.0 and p > nxt[0]]
        if stuck:
            lost.append(nxt[0] - max(prev[1], min(stuck)))
    return {"requests": reqs, "steps": steps,
            "busy_ms": round(sum(b - a for a, b, *_ in steps), 1),
            "idle_while_waiting_ms": round(sum(x for x in lost if x > 0), 1),
            "longest_idle_while_waiting_ms": round(max(lost, default=0.0), 1),
            "kernel_compiles": [(ms(t), name) for t, name in compiled]}
