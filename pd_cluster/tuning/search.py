"""Search prefill:decode counts for the highest goodput per GPU with the SLOs met (DistServe).

Candidates: every P:D with P, D >= 1 and P + D <= the GPU budget, and colocated with 1 to
budget engines. At a given rate a candidate's goodput is the requests/s that met both SLOs
(0 unless the percentile of them did). With rate "max", it is the highest rate whose SLO
attainment reaches the percentile, found by bisection below the candidate's steady-state
capacity (see `capacity`); every rate replays the
same requests with the same arrival pattern, scaled, so attainment falls with rate smoothly.
The best candidate has the highest goodput per GPU; near-ties go to fewer GPUs.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from pd_cluster.tuning.profile import Profile
from pd_cluster.tuning.simulator import ClusterSpec, EngineLimits, SimResult, Simulator
from pd_cluster.tuning.slo import SLO
from pd_cluster.tuning.workload import Workload, arrival_times

# Goodputs per GPU within this relative distance count as a tie.
TIE = 0.02
# Cap on simulated requests per run (measured + warm-up + cool-down), to bound run time.
MAX_REQUESTS = 20000


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """What to search over and how precisely."""

    gpu_budget: int
    rate: float | None                 # requests/s; None: find each candidate's max rate
    num_requests: int = 500
    burstiness: float = 1.0            # gamma shape of inter-arrival gaps (1: Poisson)
    bisect_steps: int = 10
    include_colocated: bool = True
    seed: int = 0
    gpus_per_instance: int = 1         # the profiled engine's tensor-parallel size


@dataclass(slots=True)
class Candidate:
    """One evaluated deployment."""

    spec: ClusterSpec
    rate: float                        # the rate it was judged at (its max rate, if searched)
    goodput: float                     # requests/s meeting both SLOs
    attainment: float                  # fraction of requests meeting both SLOs
    ttft: float                        # TTFT at the SLO percentile, seconds
    tpot: float                        # TPOT at the SLO percentile, seconds

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.spec.num_gpus


def candidates(gpu_budget: int, include_colocated: bool = True,
               gpus_per_instance: int = 1) -> list[ClusterSpec]:
    """Every P:D (and colocated count) that fits in the GPU budget, with instances of
    `gpus_per_instance` GPUs."""
    if gpu_budget < 1:
        raise ValueError(f"GPU budget must be at least 1, got {gpu_budget}")
    n, g = gpu_budget // gpus_per_instance, gpus_per_instance
    if n < 1:
        raise ValueError(f"GPU budget {gpu_budget} is below one instance of {g} GPUs "
                         "(the profile's tensor_parallel_size)")
    specs = [ClusterSpec(p, d, g) for p in range(1, n) for d in range(1, n - p + 1)]
    if include_colocated:
        specs += [ClusterSpec(0, k, g) for k in range(1, n + 1)]
    if not specs:
        raise ValueError("a GPU budget of 1 leaves only colocated; do not exclude it")
    return specs


@dataclass(slots=True)
class _Trace:
    """One long stream of requests at unit rate; every run replays a prefix of it, compressed.

    A run measures `measured` requests and surrounds them with a warm-up and a cool-down of
    `lifetime` seconds each: a request that meets the SLOs lives at most `lifetime`, so the
    measured ones all run under a full, steady load rather than a filling or draining one.
    """

    lengths: list[tuple[int, int]]
    unit: np.ndarray
    measured: int
    lifetime: float

    def run(self, profile: Profile, limits: EngineLimits, spec: ClusterSpec,
            rate: float) -> SimResult:
        pad = math.ceil(rate * self.lifetime)
        n = min(len(self.lengths), self.measured + 2 * pad)
        return Simulator(profile, limits, spec).run(
            self.lengths[:n], self.unit[:n] / rate, rate, slice(pad, pad + self.measured))


def search(profile: Profile, limits: EngineLimits, workload: Workload, slo: SLO,
           settings: SearchSettings, progress: bool = True) -> list[Candidate]:
    """Evaluate every candidate; returns them best first."""
    rng = np.random.default_rng(settings.seed)
    probe = workload.sample(settings.num_requests, rng)
    specs = candidates(settings.gpu_budget, settings.include_colocated,
                       settings.gpus_per_instance)
    ceilings = {spec: capacity(profile, limits, probe, spec) for spec in specs}
    lifetime = slo.ttft + (max(o for _, o in probe) - 1) * slo.tpot
    top_rate = settings.rate or max(ceilings.values())
    total = min(MAX_REQUESTS, settings.num_requests + 2 * math.ceil(top_rate * lifetime))
    trace = _Trace(probe + workload.sample(max(0, total - len(probe)), rng),
                   arrival_times(total, 1.0, settings.burstiness, rng), settings.num_requests,
                   lifetime)
    results = []
    for spec in tqdm(specs, desc="tune", disable=not progress):
        run = functools.partial(trace.run, profile, limits, spec)
        if settings.rate is not None:
            results.append(_judge(run(settings.rate), slo, settings.rate))
        else:
            results.append(_max_rate(run, slo, ceilings[spec], settings.bisect_steps))
    return rank(results)


def rank(results: list[Candidate]) -> list[Candidate]:
    """Best first: by goodput per GPU, near-ties (within TIE of the best) by fewer GPUs."""
    top = max((c.goodput_per_gpu for c in results), default=0.0)

    def key(c: Candidate) -> tuple:
        # Quantise in steps of TIE x the best, so near-equal goodputs compare equal.
        bucket = round(c.goodput_per_gpu / (TIE * top)) if top > 0 else 0
        return (-bucket, c.spec.num_gpus, -c.goodput_per_gpu)

    return sorted(results, key=key)


def _judge(result: SimResult, slo: SLO, rate: float) -> Candidate:
    q = slo.percentile
    return Candidate(result.spec, rate, result.goodput(slo), result.met_fraction(slo),
                     float(np.percentile(result.ttft, q)), float(np.percentile(result.tpot, q)))


def _max_rate(run: Callable[[float], SimResult], slo: SLO, ceiling: float,
              steps: int) -> Candidate:
    """The highest rate up to `ceiling` whose SLO attainment reaches the percentile.

    Above the steady-state capacity a finite run can still pass (the burst drains before the
    deadlines), so the search never looks above the ceiling.
    """
    lo, hi, best = 0.0, ceiling, None
    for _ in range(steps):
        mid = (lo + hi) / 2
        result = run(mid)
        if slo.attained(result.met_fraction(slo)):
            lo, best = mid, result
        else:
            hi = mid
    if best is None:
        return Candidate(result.spec, 0.0, 0.0, result.met_fraction(slo), float("inf"),
                         float("inf"))
    judged = _judge(best, slo, lo)
    judged.goodput = lo                 # DistServe: goodput is the highest rate that passes
    return judged


def capacity(profile: Profile, limits: EngineLimits, lengths: list[tuple[int, int]],
             spec: ClusterSpec) -> float:
    """Steady-state requests/s bound: full prefill steps on P, full decode batches on D
    (as many sequences as max_num_seqs and the KV capacity allow), both stages on colocated."""
    mean_in = float(np.mean([i for i, _ in lengths]))
    mean_out = float(np.mean([o for _, o in lengths]))
    tokens = limits.max_num_batched_tokens
    chunk = min(mean_in, tokens)
    prefill_s = profile.prefill_time(tokens, tokens * chunk) * mean_in / tokens
    ctx = mean_in + mean_out / 2
    batch = max(1, min(limits.max_num_seqs, int(limits.kv_capacity_tokens // (ctx + mean_out / 2))))
    decode_s = profile.decode_time(batch, batch * ctx) * max(1.0, mean_out - 1) / batch
    if spec.colocated:
        return spec.num_decode / (prefill_s + decode_s)
    return min(spec.num_prefill / prefill_s, spec.num_decode / decode_s)
