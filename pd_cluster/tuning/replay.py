"""Replay a workload whose mix shifts through the simulator, with the P:D planner deciding
between intervals or with the tiers fixed (`pd-cluster tune --planner`).

The trace: phases back to back, each `seconds` long at `rate` requests/s with its own
lengths (e.g. decode-heavy, then prompt-heavy). It is cut into intervals of `interval_s`;
each interval's requests run through the simulator on the tiers of that moment, and the
planner (pd_cluster/planner.py) reads the interval's TTFT and TPOT at the SLO percentile and
changes the tiers for the next one. A flip or an added engine counts from the next interval:
engines do not load in the replay, and queues do not carry over between intervals (each
interval starts empty), which flatters both runs alike; the comparison, not the absolute
figure, is the point. The planner predicts with the profile: before removing an engine it
simulates the interval it just saw on the smaller tiers, and keeps the engine if they would
miss an SLO.

Goodput per GPU = requests that met both SLOs / the trace's seconds / the mean GPUs held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pd_cluster.planner import Action, IntervalStats, Planner, PlannerSettings, Predict
from pd_cluster.tuning.profile import Profile
from pd_cluster.tuning.simulator import ClusterSpec, EngineLimits, Simulator
from pd_cluster.tuning.slo import SLO
from pd_cluster.tuning.workload import Workload, arrival_times


@dataclass(frozen=True, slots=True)
class Phase:
    workload: Workload
    seconds: float


@dataclass(slots=True)
class Replay:
    """One run over the trace: per interval its tiers, figures and the planner's decision."""

    planner: bool
    start: ClusterSpec
    intervals: list[dict] = field(default_factory=list)
    met: int = 0
    requests: int = 0
    gpu_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def goodput_per_gpu(self) -> float:
        gpus = self.gpu_seconds / self.seconds if self.seconds else 0.0
        return self.met / self.seconds / gpus if gpus else 0.0

    def summary(self) -> dict:
        return {"planner": self.planner, "start": str(self.start),
                "requests": self.requests, "met": self.met,
                "goodput_per_gpu": self.goodput_per_gpu,
                "mean_gpus": self.gpu_seconds / self.seconds if self.seconds else 0.0,
                "intervals": self.intervals}


def trace(phases: list[Phase], rate: float, burstiness: float, seed: int
          ) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Arrival times and lengths of every request of the phases, back to back."""
    rng = np.random.default_rng(seed)
    times, lengths, start = [], [], 0.0
    for phase in phases:
        gaps = arrival_times(max(1, round(2 * phase.seconds * rate)), rate, burstiness, rng)
        at = gaps[gaps < phase.seconds]          # the phase's own arrivals, in order
        times.append(start + at)
        lengths += phase.workload.sample(len(at), rng)
        start += phase.seconds
    return np.concatenate(times), lengths


def replay(profile: Profile, limits: EngineLimits, slo: SLO, phases: list[Phase], rate: float,
           start: ClusterSpec, interval_s: float, settings: PlannerSettings | None,
           burstiness: float = 1.0, seed: int = 0) -> Replay:
    """Run the trace interval by interval; with `settings`, the planner changes the tiers."""
    arrivals, lengths = trace(phases, rate, burstiness, seed)
    total = sum(p.seconds for p in phases)
    current: dict = {}          # the interval being decided on: its arrivals and lengths

    def predict(num_prefill: int, num_decode: int) -> tuple[float, float]:
        return interval_predictor(profile, limits, slo, start.gpus_per_instance,
                                  current["arrivals"], current["lengths"])(num_prefill,
                                                                           num_decode)

    planner = Planner(settings, predict) if settings is not None else None
    spec, out = start, Replay(planner is not None, start)
    for k in range(math.ceil(total / interval_s)):
        lo, hi = k * interval_s, min(total, (k + 1) * interval_s)
        idx = np.flatnonzero((arrivals >= lo) & (arrivals < hi))
        current.update(arrivals=arrivals[idx] - lo, lengths=[lengths[i] for i in idx])
        stats, met = _run_interval(profile, limits, slo, spec, current["arrivals"],
                                   current["lengths"], rate)
        out.met, out.requests = out.met + met, out.requests + len(idx)
        out.gpu_seconds += spec.num_gpus * (hi - lo)
        row = {"start_s": lo, "tiers": str(spec), "gpus": spec.num_gpus,
               "requests": len(idx), "met": met, "ttft": _finite(stats.ttft),
               "tpot": _finite(stats.tpot)}
        if planner is not None:
            decision = planner.decide(stats, hi)
            row.update(action=str(decision.action), reason=decision.reason)
            spec = apply(spec, decision.action)
        out.intervals.append(row)
    out.seconds = total
    return out


def interval_predictor(profile: Profile, limits: EngineLimits, slo: SLO,
                       gpus_per_instance: int, arrivals: np.ndarray,
                       lengths: list[tuple[int, int]]) -> Predict:
    """The planner's `predict`: TTFT and TPOT at the SLO percentile of one interval's
    requests (arrival seconds from the interval's start, (input, output) lengths) simulated
    on other tiers. The live planner (router/control/planner_loop.py) uses it on what routers
    measured, the replay on its trace."""
    rate = len(lengths) / max(float(arrivals.max()), 1e-3) if len(lengths) else 1.0

    def predict(num_prefill: int, num_decode: int) -> tuple[float, float]:
        stats, _ = _run_interval(profile, limits, slo,
                                 ClusterSpec(num_prefill, num_decode, gpus_per_instance),
                                 arrivals, lengths, rate)
        return stats.ttft, stats.tpot
    return predict


def apply(spec: ClusterSpec, action: Action) -> ClusterSpec:
    """The tiers after one planner action."""
    p, d = spec.num_prefill, spec.num_decode
    p, d = {Action.ADD_PREFILL: (p + 1, d), Action.ADD_DECODE: (p, d + 1),
            Action.REMOVE_PREFILL: (p - 1, d), Action.REMOVE_DECODE: (p, d - 1),
            Action.FLIP_TO_PREFILL: (p + 1, d - 1), Action.FLIP_TO_DECODE: (p - 1, d + 1),
            Action.HOLD: (p, d)}[action]
    return ClusterSpec(p, d, spec.gpus_per_instance)


def _run_interval(profile: Profile, limits: EngineLimits, slo: SLO, spec: ClusterSpec,
                  arrivals: np.ndarray, lengths: list[tuple[int, int]], rate: float
                  ) -> tuple[IntervalStats, int]:
    if not lengths:
        return IntervalStats(spec.num_prefill, spec.num_decode, math.nan, math.nan, 0), 0
    result = Simulator(profile, limits, spec).run(lengths, arrivals, rate)
    met = int(np.sum((result.ttft <= slo.ttft) & (result.tpot <= slo.tpot)))
    q = slo.percentile
    return IntervalStats(spec.num_prefill, spec.num_decode,
                         float(np.percentile(result.ttft, q)),
                         float(np.percentile(result.tpot, q)), len(lengths)), met


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
