"""A hardware profile: measured step latencies, their fitted latency models, and the file format.

DistServe's latency models, fitted by least squares on relative error:

    prefill step  = a·Σl + b·Σl² + c          l: the prompt (chunk) lengths in the step
    decode step   = a·Σctx + b·batch + c       ctx: each running sequence's context length

Σl is the linear layers' work, Σl² the attention's; Σctx is the KV read by decode attention,
batch the per-sequence work, c the fixed cost of a forward pass (weights read, launches).
A profile file is JSON: machine, model, dtype, date, engine settings, raw samples (each marked
fit or held back), fitted coefficients and the fit's error on the held-back samples, and,
once `pd-cluster profile-serving` has measured it, the serving overhead: what a request's TTFT
through the HTTP server holds beyond the engine's own steps (see `ServingOverhead`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_VERSION = 1
PREFILL_FEATURES = ("sum_tokens", "sum_sq_tokens", "const")
DECODE_FEATURES = ("sum_ctx", "batch", "const")


@dataclass(slots=True)
class Sample:
    """One measured step: its feature values (in the model's feature order) and median time."""

    features: list[float]
    seconds: float
    held_out: bool = False
    shape: dict[str, Any] = field(default_factory=dict)   # what was run, e.g. prompt lengths


@dataclass(slots=True)
class FitError:
    """Relative prediction error on the held-back samples."""

    mean_abs_pct: float
    max_abs_pct: float
    num_held_out: int


@dataclass(slots=True)
class LatencyModel:
    """A linear latency model: seconds = coef · features."""

    features: tuple[str, ...]
    coef: list[float]
    samples: list[Sample] = field(default_factory=list)
    error: FitError | None = None

    def predict(self, x: list[float] | tuple[float, ...]) -> float:
        return float(sum(c * v for c, v in zip(self.coef, x)))

    @classmethod
    def fit(cls, features: tuple[str, ...], samples: list[Sample]) -> LatencyModel:
        """Fit on the samples not held out; measure the error on those held out."""
        train = [s for s in samples if not s.held_out]
        if len(train) < len(features):
            raise ValueError(f"need at least {len(features)} fit samples, got {len(train)}")
        x = np.array([s.features for s in train], dtype=float)
        y = np.array([s.seconds for s in train], dtype=float)
        # Relative error (rows scaled by 1/y): step times span two orders of magnitude and
        # small steps matter as much as large ones.
        coef = _nonneg_lstsq(x / y[:, None], np.ones(len(y)))
        model = cls(features, coef, samples)
        held = [s for s in samples if s.held_out]
        if held:
            errors = [abs(model.predict(s.features) - s.seconds) / s.seconds for s in held]
            model.error = FitError(100 * float(np.mean(errors)), 100 * max(errors), len(held))
        return model


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares x·coef ≈ y with every coefficient >= 0.

    Non-negative, because a negative cost would let the simulator schedule work (or serve a
    request) for free. A coefficient that comes out negative is pinned to zero and the rest
    refit.
    """
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def prefill_features(lengths: list[int] | tuple[int, ...]) -> list[float]:
    """Features of a prefill step over prompts (or whole-prompt chunks) of these lengths."""
    return [float(sum(lengths)), float(sum(n * n for n in lengths)), 1.0]


def decode_features(batch: int, sum_ctx: int) -> list[float]:
    """Features of a decode step of `batch` sequences holding `sum_ctx` context tokens."""
    return [float(sum_ctx), float(batch), 1.0]


@dataclass(slots=True)
class ServingOverhead:
    """What serving adds to the engine's profiled steps, measured by `pd-cluster
    profile-serving` through a running server:

    - `coef`: seconds a request's TTFT holds beyond the engine's predicted steps (HTTP,
      tokenization, router, Ray calls, streaming back), a + b·prompt_tokens, from lone
      requests; `samples` are the per-length medians: prompt_tokens, ttft_s, engine_s and
      overhead_s.
    - `under_load`: the same serving path's seconds under the load phase, per request (its
      TTFT less the engine's share that the server reports, `engine_ttft_s`), as 21
      quantiles (0, 5, ..., 100 %); when present the simulator gives request n the quantile
      `overhead_quantile(n)` of it (plus b per token beyond the load phase's prompts), since
      under load that path takes longer and varies more than for lone requests.
    - `prefill_scale`, `decode_scale`: served steps / profiled ones, from the server's own
      step counters over a phase of Poisson load (`load` holds how; files of 2026-11-22 have
      a prefill scale from bursts instead, `burst`). A served step can be slower than the
      in-process one it was profiled as: the engine's process also takes in requests,
      reserves their KV and pushes it during the step. Lone requests never see that, queues do.
    """

    coef: list[float]                # [a seconds, b seconds per prompt token], both >= 0
    samples: list[dict[str, float]]
    url: str
    date: str
    max_num_batched_tokens: int      # the server's step budget: how engine_s was chunked
    prefill_scale: float = 1.0       # files written before it existed: steps as profiled
    burst: dict[str, Any] | None = None
    decode_scale: float = 1.0
    load: dict[str, Any] | None = None
    under_load: list[float] | None = None

    def seconds(self, prompt_tokens: int, quantile: float = 0.5) -> float:
        """One request's overhead: the `quantile` of the under-load distribution when it was
        measured (adjusted by b per token from the load phase's prompt length), else a + b·l."""
        if self.under_load is None:
            return self.coef[0] + self.coef[1] * prompt_tokens
        grid = np.linspace(0.0, 1.0, len(self.under_load))
        load = self.load or {}
        extra = self.coef[1] * (prompt_tokens - float(load.get("prompt_tokens",
                                                               load.get("input_len", 0))))
        return max(0.0, float(np.interp(quantile, grid, self.under_load)) + extra)

    def describe(self) -> str:
        if self.under_load is None:
            path = f"{1e3 * self.coef[0]:.3g} ms + {1e3 * self.coef[1]:.3g} ms/token"
        else:
            grid = np.linspace(0.0, 1.0, len(self.under_load))
            p10, p50, p90 = (1e3 * float(np.interp(q, grid, self.under_load))
                             for q in (0.1, 0.5, 0.9))
            path = f"{p50:.3g} ms under load (p10 {p10:.3g}, p90 {p90:.3g})"
        return (f"serving overhead: {path}, prefill steps x{self.prefill_scale:.3g}, decode "
                f"steps x{self.decode_scale:.3g}, measured through {self.url}")

    @classmethod
    def fit(cls, samples: list[dict[str, float]], url: str, date: str,
            max_num_batched_tokens: int, prefill_scale: float = 1.0,
            decode_scale: float = 1.0, load: dict[str, Any] | None = None,
            under_load: list[float] | None = None) -> ServingOverhead:
        """Least squares of overhead_s on prompt_tokens, both coefficients clipped to >= 0."""
        x = np.array([[1.0, s["prompt_tokens"]] for s in samples])
        return cls(_nonneg_lstsq(x, np.array([s["overhead_s"] for s in samples])), samples,
                   url, date, max_num_batched_tokens, prefill_scale, None, decode_scale, load,
                   under_load)


@dataclass(slots=True)
class Profile:
    """What `pd-cluster profile` measured, and what `pd-cluster tune` simulates with."""

    machine: dict[str, Any]
    model: dict[str, Any]            # name, layer/head shape, dtype, kv_cache_dtype (absent in
                                     # older files: the dtype), kv_bytes_per_token (the KV
                                     # cache's dtype: fp8 one byte an element)
    date: str
    engine: dict[str, Any]           # block_size, kv_capacity_tokens, max_num_batched_tokens,
                                     # tensor_parallel_size (absent in older files: 1),
                                     # kv_cache_dtype (auto | fp8; absent in older files: auto)
    prefill: LatencyModel
    decode: LatencyModel
    serving_overhead: ServingOverhead | None = None    # None: not measured (or ignored)

    @property
    def tensor_parallel_size(self) -> int:
        """GPUs of the engine that was measured: one instance of the tuned deployment."""
        return int(self.engine.get("tensor_parallel_size", 1))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token as measured (the profiled kv_cache_dtype's): what the
        simulator moves from P to D per prompt token."""
        return int(self.model["kv_bytes_per_token"])

    @property
    def kv_cache_dtype(self) -> str:
        """The measured engine's kv_cache_dtype setting (auto | fp8)."""
        return str(self.engine.get("kv_cache_dtype", "auto"))

    def prefill_time(self, sum_tokens: float, sum_sq_tokens: float) -> float:
        """A prefill step as served: the profiled one times the measured serving scale."""
        scale = self.serving_overhead.prefill_scale if self.serving_overhead else 1.0
        return scale * self.prefill.predict((sum_tokens, sum_sq_tokens, 1.0))

    def decode_time(self, batch: int, sum_ctx: float) -> float:
        """A decode step as served: the profiled one times the measured serving scale."""
        scale = self.serving_overhead.decode_scale if self.serving_overhead else 1.0
        return scale * self.decode.predict((sum_ctx, batch, 1.0))

    def overhead_time(self, prompt_tokens: int, quantile: float = 0.5) -> float:
        """Serving overhead of one request (at `quantile` of its distribution, when the
        profile has one); 0 when the profile has none."""
        return self.serving_overhead.seconds(prompt_tokens, quantile) \
            if self.serving_overhead else 0.0

    def save(self, path: str | Path) -> None:
        data = {"version": PROFILE_VERSION, **asdict(self)}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file; a missing file or a malformed one raises a clear error."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile file not found: {str(path)!r} "
                                    "(make one with `pd-cluster profile`)")
        try:
            data = json.loads(path.read_text())
            if data.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {PROFILE_VERSION}")
            # serving_overhead is optional: files written before it existed load without it.
            overhead = data.get("serving_overhead")
            return cls(data["machine"], data["model"], data["date"], data["engine"],
                       _model_from_dict(data["prefill"]), _model_from_dict(data["decode"]),
                       ServingOverhead(**overhead) if overhead else None)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a pd-cluster profile ({e})") from e


def _model_from_dict(d: dict[str, Any]) -> LatencyModel:
    error = FitError(**d["error"]) if d.get("error") else None
    return LatencyModel(tuple(d["features"]), [float(c) for c in d["coef"]],
                        [Sample(**s) for s in d.get("samples", [])], error)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int, parts: int = 2) -> int:
    """KV cache bytes one token occupies, every layer: K and V (parts 2), or one latent
    entry of head_dim values (parts 1, MLA: pd_cluster/kv_layout.py)."""
    return parts * num_layers * num_kv_heads * head_dim * dtype_bytes
