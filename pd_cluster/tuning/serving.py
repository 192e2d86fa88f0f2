"""Measure the serving overhead: TTFT through a running server minus the engine's own time.

Lone streamed requests (one at a time, after two unmeasured warm-ups) at a few prompt lengths,
timed as `pd-cluster bench` times them (send to first text). The engine's share of a lone
prompt is what the simulator predicts for it from the profile (its prefill chunks, nothing
queued); the rest, per length the median TTFT minus that, is fitted as a + b·prompt_tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import statistics
import time

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pd_cluster.benchmark.client import Endpoint, RequestRecord, send
from pd_cluster.benchmark.loadgen import make_prompt
from pd_cluster.tuning.profile import Profile, ServingOverhead
from pd_cluster.tuning.simulator import ClusterSpec, EngineLimits, Simulator

WARM_UP_REQUESTS = 2
# The first text is the one timed; more tokens make it a real decode request, as served, and
# give a model with random weights room to print: its first tokens may be pieces of one UTF-8
# character, which stream no text until it is whole.
MAX_TOKENS = 16


def engine_seconds(profile: Profile, prompt_tokens: int, max_num_batched_tokens: int) -> float:
    """The simulator's TTFT for one lone prompt on one engine, without any serving overhead."""
    bare = dataclasses.replace(profile, serving_overhead=None)
    limits = EngineLimits(int(profile.engine["kv_capacity_tokens"]), float("inf"),
                          max_num_batched_tokens)
    result = Simulator(bare, limits, ClusterSpec(0, 1)).run(
        [(prompt_tokens, 1)], np.zeros(1), rate=1.0)
    return float(result.ttft[0])


def measure_overhead(profile: Profile, endpoint: Endpoint, lengths: tuple[int, ...],
                     per_length: int, max_num_batched_tokens: int, timeout: float,
                     progress: bool = True) -> ServingOverhead:
    """Send the requests, one at a time, and fit the overhead on the per-length medians."""
    records = asyncio.run(_send_all(endpoint, lengths, per_length, timeout, progress))
    samples = []
    for n in lengths:
        mine = [r for r in records if r.input_len == n]
        tokens = round(statistics.median(r.prompt_tokens or n for r in mine))
        ttft = statistics.median(r.ttft for r in mine)
        engine = engine_seconds(profile, tokens, max_num_batched_tokens)
        samples.append({"prompt_tokens": tokens, "ttft_s": ttft, "engine_s": engine,
                        "overhead_s": ttft - engine})
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ServingOverhead.fit(samples, endpoint.base_url, date, max_num_batched_tokens)


async def _send_all(endpoint: Endpoint, lengths: tuple[int, ...], per_length: int,
                    timeout: float, progress: bool) -> list[RequestRecord]:
    """Warm-ups, then the lengths round-robin (drift on the server lands on every length).
    Prompts are fresh random text: a rerun must not find them in the prefix cache."""
    rng = np.random.default_rng()
    order = [max(lengths)] * WARM_UP_REQUESTS + list(lengths) * per_length
    records = []
    with tqdm(total=len(order), desc="profile-serving", disable=not progress) as bar:
        # `send` bounds each request by `timeout`; the session needs no limit of its own.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for k, n in enumerate(order):
                record = RequestRecord(k, n, MAX_TOKENS)
                await send(session, endpoint, record, make_prompt(n, rng),
                           time.perf_counter(), timeout)
                if not record.ok:
                    raise ValueError(f"request to {endpoint.url} failed: {record.error}")
                if k >= WARM_UP_REQUESTS:
                    records.append(record)
                bar.update(1)
    return records
