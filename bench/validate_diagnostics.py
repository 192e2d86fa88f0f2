"""What `serving_sweep.py validate` adds to a measured point to say why it differs from tune.

- `ttft_parts`: each measured request's TTFT cut at the router's and the prefill actor's own
  stamps, joined by the server's response id (the attempt id is `<response id>-0`). Every
  stamp is CLOCK_MONOTONIC of one host: bench's `records_clock_origin` + `start` is the send.
- `replay`: the simulator run on the arrivals and lengths bench actually sent (warm-up and
  cool-down included), so that a prediction and a measurement share one trace and differ
  only by the model, not by which Poisson draw each of them got.
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


def ttft_parts(report: dict, since: float, measured: slice) -> dict | None:
    """Percentiles (ms) of each part of the measured requests' TTFT, their rows, and P's
    engine steps over the run; None when the server has no prefill actors."""
    try:
        import ray

        from bench.router_overhead import borrow_client
        client = borrow_client(30.0)    # a copy, with the router's stamps as of now
        prefill = list(getattr(client, "prefill", []) or [])
        if not prefill:
            return None
        rows = ray.get([p.stage_times.remote() for p in prefill], timeout=30)
        diag = ray.get([p.diagnostics.remote(since) for p in prefill], timeout=30)
    except Exception as e:  # noqa: BLE001 - a diagnostic: never lose the measured point
        return {"error": repr(e)[:300]}
    p_stamps = {r[0]: r[1:] for actor_rows in rows for r in actor_rows}
    ms = join_parts(report["records"][measured], report.get("records_clock_origin"),
                    {r[0]: r[1:] for r in client.stamps}, p_stamps) * 1e3
    steps = [b - a for d in diag for a, b, *_ in d.get("step_log", [])]
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
