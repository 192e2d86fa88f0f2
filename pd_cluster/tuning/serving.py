"""Measure what serving adds to the profiled engine, through a running server: how long its
engines' steps take as served, and what a request's TTFT holds beyond them.

Two phases, both timed as `pd-cluster bench` times them (send to first text), with fresh
random prompts (a rerun must not find them in the prefix cache):

- Load: Poisson arrivals of `load_input_len`-token prompts (default: the longest length) at
  `load_rate` (default: half of what the served prefill engines can take by the profile)
  for `load_requests` requests. The server's /metrics count its engines' steps by kind with
  their seconds and their work in the profile's features (`pd_engine_step_*`), so the sum of
  the profile's predictions over the phase's prefill-only steps, against their measured
  seconds, is `prefill_scale`; decode-only steps give `decode_scale`. Served steps can be
  slower than profiled ones: the engine's process also takes in requests, reserves their KV
  on the decode side and pushes it during them. A pd-cluster server also says, per request,
  how much of its TTFT the engine took (`engine_ttft_s` in the usage chunk); the rest is the
  serving path under load (HTTP, router, Ray calls, the way back), kept as quantiles
  (`under_load`) that the simulator draws each request's overhead from.
- Lone requests, one at a time, at each length: the overhead is the median TTFT minus the
  simulator's prediction for the lone prompt with the scaled steps, fitted as a + b·tokens
  (without an under-load measurement, a is the overhead; with one, b still adjusts it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import re
import statistics
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pd_cluster.benchmark.client import NO_TEXT, Endpoint, RequestRecord, send
from pd_cluster.benchmark.loadgen import make_prompt
from pd_cluster.role import Role
from pd_cluster.tuning.profile import LatencyModel, Profile, ServingOverhead
from pd_cluster.tuning.simulator import ClusterSpec, EngineLimits, Simulator
from pd_cluster.tuning.workload import arrival_times

WARM_UP_REQUESTS = 2
# The first text is the one timed; more tokens make it a real decode request, as served, and
# give a model with random weights room to print: its first tokens may be pieces of one UTF-8
# character, which stream no text until it is whole.
MAX_TOKENS = 16
TEXT_RETRIES = 3
SCALE_RANGE = (0.25, 8.0)
# Steps of a kind below which its scale is not measured (stays 1).
MIN_STEPS = 10
# Load-phase requests with the engine's TTFT share below which the serving path under load
# is not measured (the lone-request fit stands alone).
MIN_UNDER_LOAD = 20


def _metrics(base_url: str, timeout: float) -> str:
    """The server's Prometheus text ("" when it has no /metrics)."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/metrics", timeout=timeout) as answer:
            return answer.read().decode()
    except OSError:
        return ""


def served_shape(base_url: str, timeout: float = 10.0) -> ClusterSpec:
    """Prefill and decode engine counts from a pd-cluster server's /metrics (its engines'
    `role` and `replica` labels); one colocated engine for a server without them."""
    text = _metrics(base_url, timeout)
    engines = set()
    for line in text.splitlines():
        if line.startswith("pd_kv_blocks_used{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            engines.add((labels.get("role"), labels.get("replica")))
    prefill = sum(role == Role.PREFILL for role, _ in engines)
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


def read_step_totals(base_url: str, timeout: float = 10.0) -> dict[str, dict[str, float]]:
    """A pd-cluster server's engine step totals by kind ("prefill", "decode", "mixed"), summed
    over its engines: steps, seconds and each feature of `STEP_FEATURES`; {} without them."""
    text = _metrics(base_url, timeout)
    totals: dict[str, dict[str, float]] = {}
    names = {"pd_engine_steps_total": "steps", "pd_engine_step_seconds_total": "seconds"}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in names and name != "pd_engine_step_work_total":
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        key = names.get(name) or labels["feature"]
        kind = totals.setdefault(labels["kind"], {})
        kind[key] = kind.get(key, 0.0) + float(rest.rsplit(" ", 1)[1])
    return totals


def served_scales(profile: Profile, before: dict, after: dict,
                  min_steps: int = MIN_STEPS) -> dict[str, Any]:
    """Measured seconds / the profile's predicted seconds over the prefill-only steps and over
    the decode-only steps between two `read_step_totals`; a kind with fewer than `min_steps`
    steps keeps scale 1 (mixed steps, a colocated engine's, are counted, not used)."""
    def delta(kind: str) -> dict[str, float]:
        return {k: v - before.get(kind, {}).get(k, 0.0) for k, v in after.get(kind, {}).items()}

    out: dict[str, Any] = {}
    for kind, model, scale_key in (("prefill", profile.prefill, "prefill_scale"),
                                   ("decode", profile.decode, "decode_scale")):
        d = delta(kind)
        steps = d.get("steps", 0.0)
        predicted = model.predict(tuple(steps if f == "const" else d.get(f, 0.0)
                                        for f in model.features)) if steps else 0.0
        out[kind] = {"steps": int(steps), "seconds": d.get("seconds", 0.0),
                     "profiled_seconds": predicted,
                     **{f: d.get(f, 0.0) for f in model.features if f != "const"}}
        scale = 1.0
        if steps >= min_steps and predicted > 0:
            scale = min(max(d["seconds"] / predicted, SCALE_RANGE[0]), SCALE_RANGE[1])
        out[scale_key] = scale
    mixed = delta("mixed")
    out["mixed"] = {"steps": int(mixed.get("steps", 0.0)), "seconds": mixed.get("seconds", 0.0)}
    return out


def default_load_rate(profile: Profile, spec: ClusterSpec, prompt_tokens: int,
                      max_num_batched_tokens: int) -> float:
    """Half of what the served prefill engines (colocated ones when there are none) can take
    of `prompt_tokens`-token prompts, by the profile's steps."""
    engines = spec.num_prefill or spec.num_decode
    return 0.5 * engines / engine_seconds(profile, prompt_tokens, max_num_batched_tokens)


def measure_overhead(profile: Profile, endpoint: Endpoint, lengths: tuple[int, ...],
                     per_length: int, max_num_batched_tokens: int, timeout: float,
                     progress: bool = True, load_requests: int = 64,
                     load_rate: float | None = None, load_input_len: int | None = None,
                     load_output_len: int = 128) -> ServingOverhead:
    """The load phase first (the step scales), then lone requests (the overhead on top)."""
    spec = served_shape(endpoint.base_url)
    scales, load, under_load = {"prefill_scale": 1.0, "decode_scale": 1.0}, None, None
    if load_requests > 0:
        if not read_step_totals(endpoint.base_url):
            raise ValueError(f"{endpoint.base_url}: its /metrics has no pd_engine_step_* "
                             "counters (not a pd-cluster server?); pass --load-requests 0")
        input_len = load_input_len or max(lengths)
        rate = load_rate or default_load_rate(profile, spec, input_len, max_num_batched_tokens)
        totals: list[dict] = []
        records = asyncio.run(_send_load(endpoint, load_requests, rate, input_len,
                                         load_output_len, timeout, progress,
                                         lambda: totals.append(read_step_totals(
                                             endpoint.base_url))))
        scales = served_scales(profile, *totals)
        load = {"served": str(spec), "requests": load_requests, "rate": rate,
                "input_len": input_len, "output_len": load_output_len,
                "prompt_tokens": statistics.median(r.prompt_tokens or input_len
                                                   for r in records),
                "duration_s": max(r.start + r.e2e for r in records), **scales}
        under_load = serving_path_quantiles(records)
        if under_load is not None:
            load["serving_path_ms"] = {f"p{q}": round(1e3 * under_load[q // 5], 2)
                                       for q in (10, 50, 90)}
    records = asyncio.run(_send_all(endpoint, lengths, per_length, timeout, progress))
    samples = []
    for n in lengths:
        mine = [r for r in records if r.input_len == n]
        tokens = round(statistics.median(r.prompt_tokens or n for r in mine))
        ttft = statistics.median(r.ttft for r in mine)
        engine = engine_seconds(profile, tokens, max_num_batched_tokens,
                                scales["prefill_scale"])
        samples.append({"prompt_tokens": tokens, "ttft_s": ttft, "engine_s": engine,
                        "overhead_s": ttft - engine})
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ServingOverhead.fit(samples, endpoint.base_url, date, max_num_batched_tokens,
                               scales["prefill_scale"], scales["decode_scale"], load,
                               under_load)


def serving_path_quantiles(records: list[RequestRecord]) -> list[float] | None:
    """0, 5, ..., 100 % quantiles of TTFT less the engine's share (`engine_ttft_s`, which
    pd-cluster servers report) over `records`; None when too few carry it."""
    path = [r.ttft - r.engine_ttft for r in records if r.ok and r.engine_ttft is not None]
    if len(path) < MIN_UNDER_LOAD:
        return None
    return [float(x) for x in np.percentile(np.maximum(path, 0.0), np.linspace(0, 100, 21))]


def _check(record: RequestRecord, endpoint: Endpoint) -> RequestRecord:
    if not record.ok:
        raise ValueError(f"request to {endpoint.url} failed: {record.error}")
    return record


async def _timed(session: aiohttp.ClientSession, endpoint: Endpoint, index: int,
                 input_len: int, rng: np.random.Generator, timeout: float) -> RequestRecord:
    """One lone request of MAX_TOKENS whose TTFT must be timed: a response without text
    (random weights can print nothing that short) is sent again with a fresh prompt, up to
    TEXT_RETRIES times; any other failure raises."""
    for _ in range(TEXT_RETRIES):
        record = await send(session, endpoint, RequestRecord(index, input_len, MAX_TOKENS),
                            make_prompt(input_len, rng), time.perf_counter(), timeout)
        if record.error != NO_TEXT:
            break
    return _check(record, endpoint)


async def _send_load(endpoint: Endpoint, n: int, rate: float, input_len: int,
                     output_len: int, timeout: float, progress: bool,
                     snapshot: Callable[[], None]) -> list[RequestRecord]:
    """Warm-ups one at a time, `snapshot()`, `n` requests at Poisson arrivals of `rate`
    per second, all answered, `snapshot()` again."""
    rng = np.random.default_rng()
    starts = arrival_times(n, rate, 1.0, rng)
    with tqdm(total=WARM_UP_REQUESTS + n, desc="profile-serving load",
              disable=not progress) as bar:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for k in range(WARM_UP_REQUESTS):
                await _timed(session, endpoint, k, input_len, rng, timeout)
                bar.update(1)
            await asyncio.to_thread(snapshot)
            t0 = time.perf_counter()

            async def one(k: int) -> RequestRecord:
                await asyncio.sleep(max(0.0, starts[k] - (time.perf_counter() - t0)))
                record = await send(session, endpoint, RequestRecord(k, input_len, output_len),
                                    make_prompt(input_len, rng), t0, timeout)
                bar.update(1)
                # Its arrival was the load's: no resend. One without text still loaded the
                # engines (the step counters have it); it only has no TTFT to keep.
                return record if record.error == NO_TEXT else _check(record, endpoint)

            records = await asyncio.gather(*[one(k) for k in range(n)])
            await asyncio.to_thread(snapshot)
    return list(records)


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
                record = await _timed(session, endpoint, k, n, rng, timeout)
                if k >= WARM_UP_REQUESTS:
                    records.append(record)
                bar.update(1)
    return records
