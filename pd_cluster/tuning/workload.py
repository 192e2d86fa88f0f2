"""Workloads: request input/output lengths (from a file or distributions) and arrival times.

Shared by `tune` (which simulates them) and `bench` (which sends them), so both see the same
requests for the same seed. Length files: JSON lines or a JSON list of objects with
`input_len` and `output_len`, or a CSV with those two columns in its header.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Distribution text: "128" or "fixed:128", "uniform:LO:HI", "normal:MEAN:STD",
# "lognormal:MEDIAN:SIGMA", "exp:MEAN". Every draw is rounded and clipped to >= 1 token.
_PARAMS = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}


@dataclass(frozen=True, slots=True)
class Distribution:
    """A length distribution in tokens."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str, what: str = "length") -> Distribution:
        """Parse "128", "uniform:100:1024", ...; a bad text raises a ValueError naming `what`."""
        parts = str(text).strip().split(":")
        kind = "fixed" if len(parts) == 1 else parts[0].lower()
        values = parts if len(parts) == 1 else parts[1:]
        usage = (f"{what}: {text!r} is not a length distribution; use N, fixed:N, "
                 "uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA or exp:MEAN")
        if kind not in _PARAMS or len(values) != _PARAMS[kind]:
            raise ValueError(usage)
        try:
            params = tuple(float(v) for v in values)
        except ValueError:
            raise ValueError(usage) from None
        if not all(math.isfinite(p) and p > 0 for p in params):
            raise ValueError(f"{what}: parameters must be positive numbers, got {text!r}")
        if kind == "uniform" and params[0] > params[1]:
            raise ValueError(f"{what}: uniform needs LO <= HI, got {text!r}")
        return cls(kind, params)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            x = np.full(n, p[0])
        elif self.kind == "uniform":
            x = rng.integers(int(p[0]), int(p[1]) + 1, n)
        elif self.kind == "normal":
            x = rng.normal(p[0], p[1], n)
        elif self.kind == "lognormal":
            x = rng.lognormal(math.log(p[0]), p[1], n)
        else:
            x = rng.exponential(p[0], n)
        return np.maximum(1, np.rint(x)).astype(int)

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{v:g}" for v in self.params)])


@dataclass(frozen=True, slots=True)
class Workload:
    """Where request lengths come from: pairs read from a file, or two distributions."""

    pairs: tuple[tuple[int, int], ...] | None = None
    input_len: Distribution | None = None
    output_len: Distribution | None = None
    source: str = ""

    @classmethod
    def from_args(cls, file: str | None, input_len: str | None,
                  output_len: str | None) -> Workload:
        if file:
            return cls(pairs=tuple(load_lengths(file)), source=str(file))
        inp = Distribution.parse(input_len or "512", "input length")
        out = Distribution.parse(output_len or "128", "output length")
        return cls(input_len=inp, output_len=out, source=f"input {inp}, output {out}")

    def sample(self, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
        """n (input, output) length pairs; file pairs are drawn with replacement."""
        if self.pairs is not None:
            picks = rng.integers(0, len(self.pairs), n)
            return [self.pairs[i] for i in picks]
        return list(zip(self.input_len.sample(n, rng).tolist(),
                        self.output_len.sample(n, rng).tolist()))


def load_lengths(path: str | Path) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs from a JSON, JSON-lines or CSV file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file not found: {str(path)!r}")
    text = path.read_text()
    if path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    elif text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    try:
        pairs = [(int(r["input_len"]), int(r["output_len"])) for r in rows]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: every row needs integer input_len and output_len ({e})") \
            from None
    if not pairs or min(min(p) for p in pairs) < 1:
        raise ValueError(f"{path}: needs at least one row, with lengths >= 1")
    return pairs


def arrival_times(n: int, rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Start times of n requests at `rate` per second with gamma-distributed gaps.

    burstiness is the gamma shape: 1 is a Poisson process, below 1 burstier, above 1 steadier.
    An infinite rate sends everything at time 0.
    """
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    return np.cumsum(gaps) - gaps[0]
