"""The reductions of bench/kv_tiers_serving.py (issue 47): a multi-turn run's numbers, the
tiers' loads from an engine's counters, the off / on comparison, and the pinned host ->
device copy rate the loads are judged against."""
from __future__ import annotations

from typing import Any

import numpy as np

TTFT_SLOS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)      # goodput re-judged at these, from records


def pinned_copy() -> dict | None:
    """Pinned host -> GPU copy rate: one 256 MiB copy (a 2k-token 8B prompt's KV), and the
    same bytes in 32 KiB pieces (one block's K or V of one layer at block 16), median of 5."""
    import torch

    if not torch.cuda.is_available():
        return None
    nbytes, piece = 256 * 2**20, 32 * 2**10
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"bytes": nbytes, "whole_gbps": _copy_rate(host, dev, nbytes), "piece_bytes": piece,
           "pieces_gbps": _copy_rate(host, dev, piece)}
    del host, dev
    torch.cuda.empty_cache()
    return out


def _copy_rate(host: Any, dev: Any, step: int) -> float:
    """GB/s of copying `host` into `dev` in `step`-byte pieces: median of 5 after a warm-up."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(6):
        start.record()
        for at in range(0, host.numel(), step):
            dev[at:at + step].copy_(host[at:at + step], non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return host.numel() / float(np.median(times[1:])) / 1e9


def tier_metrics(before: dict, after: dict) -> dict[str, float]:
    """How every `pd_kv_tier*` series of the router's /metrics (router/kv_tier_metrics.py)
    moved over a run (gauges: their value after it), keyed `name{label=value,...}`; from
    serving_runs.scrape's {(name, labels): value}."""
    gauge = ("_used_bytes", "_capacity_bytes")
    return {name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}":
            value if name.endswith(gauge) else value - before.get((name, labels), 0.0)
            for (name, labels), value in after.items() if name.startswith("pd_kv_tier")}


def host_loads(before: dict, after: dict, block_bytes: int) -> dict | None:
    """The tiers' loads over a run, from the engine's counters: bytes, seconds (lookups and
    round trips included), per load (a load is one prompt's prefix), and the bandwidth."""
    keys = ("host_hits", "disk_hits", "loads", "load_s", "recomputed", "offloaded", "errors")
    if not all(isinstance(after.get(k), (int, float)) for k in keys):
        return None
    d = {k: after[k] - before.get(k, 0) for k in keys}
    nbytes = (d["host_hits"] + d["disk_hits"]) * block_bytes
    return {**d, "bytes": nbytes, "gbps": nbytes / d["load_s"] / 1e9 if d["load_s"] else None,
            "bytes_per_load": nbytes / d["loads"] if d["loads"] else None,
            "seconds_per_load": d["load_s"] / d["loads"] if d["loads"] else None,
            "state": after.get("state"), "cost_rule_host_gbps": after.get("host_gbps"),
            "cost_rule_prefill_tokens_per_s": after.get("prefill_tokens_per_s")}


def summary(report: dict) -> dict:
    """The numbers a comparison needs, in ms where they are latencies."""
    ms = lambda v: None if v is None else round(v * 1e3, 3)
    ok = [r for r in report["records"] if r["ok"]]
    tpot_ok = [r for r in ok if r["tpot"] is not None and r["tpot"] <= report["slo"]["tpot"]]
    return {
        "requests": report["requests"], "completed": report["completed"],
        "errors": report["errors"], "duration_s": round(report["duration_s"], 3),
        "conversations_completed": report["conversations_completed"],
        "ttft_ms_p50": ms(report["ttft"]["p50"]), "ttft_ms_p90": ms(report["ttft"]["p90"]),
        "tpot_ms_p50": ms(report["tpot"]["p50"]), "tpot_ms_p90": ms(report["tpot"]["p90"]),
        "request_throughput": report["request_throughput"],
        "output_token_throughput": report["output_token_throughput"],
        "goodput": report["goodput"], "slo_attainment": report["slo_attainment"],
        "goodput_at_ttft_slo": {f"{int(s * 1e3)}ms": sum(r["ttft"] <= s for r in tpot_ok)
                                / report["duration_s"] for s in TTFT_SLOS},
        "cached_fraction": report["cached_fraction"],
        "per_turn": [{"turn": t["turn"], "completed": t["completed"],
                      "ttft_ms_p50": ms(t["ttft"]["p50"]), "ttft_ms_p90": ms(t["ttft"]["p90"]),
                      "prompt_tokens_mean": t["prompt_tokens_mean"],
                      "cached_tokens_mean": t["cached_tokens_mean"],
                      "slo_attainment": t["slo_attainment"]} for t in report["per_turn"]],
    }


def compare(runs: dict, copy: dict | None) -> dict | None:
    if not {"off", "on"} <= set(runs) or any("error" in runs[k] for k in ("off", "on")):
        return None
    off, on = runs["off"], runs["on"]
    div = lambda a, b: round(a / b, 3) if a is not None and b else None
    out = {"ttft_p50_off_over_on": div(off["ttft_ms_p50"], on["ttft_ms_p50"]),
           "ttft_p90_off_over_on": div(off["ttft_ms_p90"], on["ttft_ms_p90"]),
           "goodput_on_over_off": div(on["goodput"], off["goodput"]),
           "goodput_on_over_off_at_ttft_slo": {
               k: div(on["goodput_at_ttft_slo"][k], v)
               for k, v in off["goodput_at_ttft_slo"].items()},
           "tiers_on_in_the_engine": on["tier_stats"].get("state") == "on"}
    loads = on.get("host_loads")
    if loads and loads.get("gbps") and copy:
        out["host_load_gbps_over_pinned_copy"] = div(loads["gbps"], copy["whole_gbps"])
    return out
