"""Measure what serving adds to the profiled engine: TTFT through a running server against the
simulator's prediction from the profile.

Two measurements, both timed as `pd-cluster bench` times them (send to first text), with
fresh random prompts (a rerun must not find them in the prefix cache):

- Bursts: `burst_size` prompts of the longest length sent at once, `bursts` times. A burst
  queues on the prefill engines, so its sorted TTFTs climb by one served prefill step per
  prompt (per prefill engine). The simulator replays the same burst on the served shape (P and
  D counts, read from the server's /metrics), and `prefill_scale` is the factor on the
  profile's prefill steps that gives the climb measured (median of the bursts' least-squares
  slopes of TTFT against rank; a fixed overhead does not change a slope).
- Lone requests, one at a time, at each length: the overhead is the median TTFT minus the
  simulator's prediction for the lone prompt with the scaled steps, fitted as a + b·tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import re
import statistics
import time
import urllib.request

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pd_cluster.benchmark.client import Endpoint, RequestRecord, send
from pd_cluster.benchmark.loadgen import make_prompt
from pd_cluster.tuning.profile import LatencyModel, Profile, ServingOverhead
from pd_cluster.tuning.simulator import ClusterSpec, EngineLimits, Simulator

WARM_UP_REQUESTS = 2
# The first text is the one timed; more tokens make it a real decode request, as served, and
# give a model with random weights room to print: its first tokens may be pieces of one UTF-8
# character, which stream no text until it is whole.
MAX_TOKENS = 16
SCALE_RANGE = (0.25, 8.0)


def served_shape(base_url: str, timeout: float = 10.0) -> ClusterSpec:
    """Prefill and decode engine counts from a pd-cluster server's /metrics (its engines'
    `role` and `replica` labels); one colocated engine for a server without them."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/metrics", timeout=timeout) as answer:
            text = answer.read().decode()
    except OSError:
        return ClusterSpec(0, 1)
    engines = set()
    for line in text.splitlines():
        if line.startswith("pd_kv_blocks_used{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            engines.add((labels.get("role"), labels.get("replica")))
    prefill = sum(role == "prefill" for role, _ in engines)
    return ClusterSpec(prefill, max(1, len(engines) - prefill))


def simulated_ttfts(profile: Profile, spec: ClusterSpec, prompts: list[tuple[int, int]],
                    max_num_batched_tokens: int, scale: float = 1.0) -> np.ndarray:
    """The simulator's TTFTs for `prompts` (input, output) all arriving at 0, prefill steps
    times `scale`, no serving overhead."""
    prefill = LatencyModel(profile.prefill.features, [scale * c for c in profile.prefill.coef])
    bare = dataclasses.replace(profile, prefill=prefill, serving_overhead=None)
    limits = EngineLimits(int(profile.engine["kv_capacity_tokens"]), float("inf"),
                          max_num_batched_tokens)
    result = Simulator(bare, limits, spec).run(prompts, np.zeros(len(prompts)), rate=1.0)
    return np.sort(np.asarray(result.ttft, dtype=float))


def engine_seconds(profile: Profile, prompt_tokens: int, max_num_batched_tokens: int,
                   scale: float = 1.0) -> float:
    """The simulator's TTFT for one lone prompt on one engine, without any serving overhead."""
    return float(simulated_ttfts(profile, ClusterSpec(0, 1), [(prompt_tokens, 1)],
                                 max_num_batched_tokens, scale)[0])


def climb(ttfts: np.ndarray) -> float:
    """Least-squares slope of sorted TTFTs against their rank: seconds per queued prompt."""
    return float(np.polyfit(np.arange(len(ttfts)), np.sort(ttfts), 1)[0])


def fit_prefill_scale(profile: Profile, spec: ClusterSpec, prompt_tokens: int, size: int,
                      measured_climb: float, max_num_batched_tokens: int) -> float:
    """The factor on prefill steps whose simulated burst climbs as measured (bisection: the
    climb grows with the factor), clipped to SCALE_RANGE."""
    def simulated(scale: float) -> float:
        return climb(simulated_ttfts(profile, spec, [(prompt_tokens, MAX_TOKENS)] * size,
                                     max_num_batched_tokens, scale))
    lo, hi = SCALE_RANGE
    if measured_climb <= simulated(lo):
        return lo
    if measured_climb >= simulated(hi):
        return hi
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if simulated(mid) < measured_climb else (lo, mid)
    return (lo * hi) ** 0.5


def measure_overhead(profile: Profile, endpoint: Endpoint, lengths: tuple[int, ...],
                     per_length: int, max_num_batched_tokens: int, timeout: float,
                     progress: bool = True, burst_size: int = 8,
                     bursts: int = 3) -> ServingOverhead:
    """Bursts first (the prefill scale), then lone requests (the overhead on top of it)."""
    spec = served_shape(endpoint.base_url)
    longest = max(lengths)
    scale, burst = 1.0, None
    if burst_size > 1 and bursts > 0:
        runs = asyncio.run(_send_bursts(endpoint, longest, burst_size, bursts, timeout,
                                        progress))
        tokens = round(statistics.median(r.prompt_tokens or longest for run in runs
                                         for r in run))
        climbs = [climb(np.array([r.ttft for r in run])) for run in runs]
        measured = statistics.median(climbs)
        scale = fit_prefill_scale(profile, spec, tokens, burst_size, measured,
                                  max_num_batched_tokens)
        burst = {"served": str(spec), "size": burst_size, "prompt_tokens": tokens,
                 "ttfts_s": [sorted(r.ttft for r in run) for run in runs],
                 "climbs_s": climbs, "climb_s": measured,
                 "profiled_climb_s": climb(simulated_ttfts(
                     profile, spec, [(tokens, MAX_TOKENS)] * burst_size,
                     max_num_batched_tokens))}
    records = asyncio.run(_send_all(endpoint, lengths, per_length, timeout, progress))
    samples = []
    for n in lengths:
        mine = [r for r in records if r.input_len == n]
        tokens = round(statistics.median(r.prompt_tokens or n for r in mine))
        ttft = statistics.median(r.ttft for r in mine)
        engine = engine_seconds(profile, tokens, max_num_batched_tokens, scale)
        samples.append({"prompt_tokens": tokens, "ttft_s": ttft, "engine_s": engine,
                        "overhead_s": ttft - engine})
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ServingOverhead.fit(samples, endpoint.base_url, date, max_num_batched_tokens,
                               scale, burst)


def _check(record: RequestRecord, endpoint: Endpoint) -> RequestRecord:
    if not record.ok:
        raise ValueError(f"request to {endpoint.url} failed: {record.error}")
    return record


async def _send_bursts(endpoint: Endpoint, length: int, size: int, bursts: int,
                       timeout: float, progress: bool) -> list[list[RequestRecord]]:
    """Warm-ups one at a time, then `bursts` bursts of `size` prompts sent together; each
    burst starts once the one before has finished."""
    rng = np.random.default_rng()
    runs = []
    with tqdm(total=WARM_UP_REQUESTS + bursts, desc="profile-serving bursts",
              disable=not progress) as bar:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for k in range(WARM_UP_REQUESTS):
                record = RequestRecord(k, length, MAX_TOKENS)
                _check(await send(session, endpoint, record, make_prompt(length, rng),
                                  time.perf_counter(), timeout), endpoint)
                bar.update(1)
            for _ in range(bursts):
                t0 = time.perf_counter()
                batch = [send(session, endpoint, RequestRecord(i, length, MAX_TOKENS),
                              make_prompt(length, rng), t0, timeout) for i in range(size)]
                runs.append([_check(r, endpoint) for r in await asyncio.gather(*batch)])
                bar.update(1)
    return runs


async def _send_all(endpoint: Endpoint, lengths: tuple[int, ...], per_length: int,
                    timeout: float, progress: bool) -> list[RequestRecord]:
    """Warm-ups, then the lengths round-robin (drift on the server lands on every length)."""
    rng = np.random.default_rng()
    order = [max(lengths)] * WARM_UP_REQUESTS + list(lengths) * per_length
    records = []
    with tqdm(total=len(order), desc="profile-serving", disable=not progress) as bar:
        # `send` bounds each request by `timeout`; the session needs no limit of its own.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for k, n in enumerate(order):
                record = RequestRecord(k, n, MAX_TOKENS)
                _check(await send(session, endpoint, record, make_prompt(n, rng),
                                  time.perf_counter(), timeout), endpoint)
                if k >= WARM_UP_REQUESTS:
                    records.append(record)
                bar.update(1)
    return records
