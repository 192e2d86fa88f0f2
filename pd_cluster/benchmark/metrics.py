"""Summaries of a benchmark run: latency percentiles, throughput and goodput under SLOs.

goodput = requests that completed and met both the TTFT and the TPOT objective / duration,
so it can be recomputed from the per-request records the JSON report carries.
"""
from __future__ import annotations

from dataclasses import asdict

import numpy as np

from pd_cluster.benchmark.client import RequestRecord
from pd_cluster.tuning.slo import SLO

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 in seconds (None when there are no values)."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()),
            **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}}


def summarize(records: list[RequestRecord], duration: float, slo: SLO) -> dict:
    """The report: counts, throughput, latency distributions, SLO attainment and goodput."""
    done = [r for r in records if r.ok]
    for r in records:
        r.met_slo = r.ok and slo.met(r.ttft, r.tpot)
    met = sum(r.met_slo for r in records)
    samples = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if
                                                        r.output_tokens > 1],
               "itl": [gap for r in done for gap in r.itl], "e2e": [r.e2e for r in done]}
    return {
        "duration_s": duration,
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "request_throughput": len(done) / duration,
        "input_token_throughput": sum(r.prompt_tokens or r.input_len for r in done) / duration,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration,
        **{name: distribution(samples[name]) for name in LATENCIES},
        "slo": asdict(slo),
        "slo_attainment": met / len(records) if records else 0.0,
        "slo_met_requests": met,
        "goodput": met / duration,
    }


def format_summary(report: dict) -> str:
    """A short human-readable block of the report's numbers (latencies in ms)."""
    lines = [f"requests {report['completed']}/{report['requests']} completed in "
             f"{report['duration_s']:.2f} s ({report['failed']} failed)",
             f"throughput {report['request_throughput']:.3g} req/s, "
             f"{report['input_token_throughput']:.4g} input tok/s, "
             f"{report['output_token_throughput']:.4g} output tok/s"]
    for name in LATENCIES:
        d = report[name]
        cells = "  ".join(f"{k} {_ms(v)}" for k, v in d.items())
        lines.append(f"{name.upper():5} {cells}")
    lines.append(f"SLO met by {100 * report['slo_attainment']:.1f}% of requests; goodput "
                 f"{report['goodput']:.3g} req/s")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
