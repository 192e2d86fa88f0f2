"""Service-level objectives and the units users write them in.

    parse_duration("200ms") == 0.2      parse_bandwidth("25GB/s") == 25e9
    parse_percentile("p90") == 90.0     parse_rate("max") is None
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s|)\s*$", re.I)
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(b|bps|b/s)?\s*$", re.I)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_duration(text: str | float, what: str = "duration") -> float:
    """Seconds from "200ms", "0.2s", "150us" or a bare number of seconds; must be > 0."""
    m = _DURATION.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{what}: cannot read {text!r} as a positive duration "
                         "(e.g. 200ms, 0.2s, 0.2)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def parse_percentile(text: str | float) -> float:
    """A percentile in (0, 100] from "p90", "90" or "99.9"."""
    raw = str(text).strip().lower().removeprefix("p")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 100:
        raise ValueError(f"SLO percentile: {text!r} is not in (0, 100], e.g. p90 or 99")
    return value


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second from "25GB/s", "50 GB/s", "400Gbps" (bits) or a bare number of B/s."""
    m = _BANDWIDTH.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"KV bandwidth: cannot read {text!r} as a positive bandwidth "
                         "(e.g. 25GB/s, 400Gbps)")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    unit = m.group(3) or ""
    # "b" in "Gbps" or "Gb/s" is bits; "B" is bytes. A bare "bps" is bits too.
    bits = unit.lower() == "bps" or (unit[:1] == "b")
    return value / 8 if bits else value


def parse_rate(text: str | float) -> float | None:
    """Requests per second (> 0), or None for "max" (find the highest rate the SLOs allow)."""
    if str(text).strip().lower() == "max":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise ValueError(f"rate: {text!r} is neither a positive number of requests/s nor max")
    return value


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request latency objectives, to be met by `percentile` % of the requests."""

    ttft: float              # seconds to the first token
    tpot: float              # seconds per output token after the first
    percentile: float = 90.0

    def met(self, ttft: float, tpot: float) -> bool:
        """Whether one request met both objectives."""
        return ttft <= self.ttft and tpot <= self.tpot

    def attained(self, fraction_met: float) -> bool:
        """Whether a run in which `fraction_met` of requests met both objectives passes."""
        return fraction_met * 100 >= self.percentile - 1e-9

    def __str__(self) -> str:
        return (f"TTFT <= {self.ttft * 1e3:g} ms and TPOT <= {self.tpot * 1e3:g} ms "
                f"for p{self.percentile:g}")

    @classmethod
    def parse(cls, ttft: str, tpot: str, percentile: str) -> SLO:
        return cls(parse_duration(ttft, "TTFT SLO"), parse_duration(tpot, "TPOT SLO"),
                   parse_percentile(percentile))
