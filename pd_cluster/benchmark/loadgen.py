"""The load generator: prompts of given lengths sent at a rate (Poisson or gamma) or at a
fixed concurrency, each with a timeout, the whole run bounded in requests and time."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from pd_cluster.benchmark.client import Endpoint, RequestRecord, send
from pd_cluster.tuning.workload import Workload, arrival_times

# Common English words that BPE tokenizers keep whole (with their leading space), so a prompt
# of n words is close to n tokens; the server's usage reports the exact count.
_WORDS = ("time year people way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city name "
          "team minute idea kid body back parent face others level office door health person "
          "art war history party result change morning reason research girl guy moment air "
          "teacher force education foot boy age policy music market sense nation plan college "
          "interest death experience effect use class control care field development role").split()


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """How much load, and its shape."""

    num_requests: int
    rate: float | None = None           # requests/s (math.inf: all at once); None: concurrency
    concurrency: int | None = None      # requests kept in flight, back to back
    burstiness: float = 1.0             # gamma shape of arrival gaps; 1 = Poisson
    timeout: float = 300.0              # per request
    max_duration: float = 3600.0        # no request starts after this many seconds
    seed: int = 0


def make_prompt(num_words: int, rng: np.random.Generator) -> str:
    """Random text of `num_words` common words (about as many tokens)."""
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), num_words))


async def run_load(endpoint: Endpoint, workload: Workload, load: LoadSettings,
                   progress: bool = True) -> tuple[list[RequestRecord], float, float]:
    """Send the workload; returns per-request records (in request order), the duration
    from the first send to the last completion, and the `time.perf_counter()` the records'
    `start` counts from (CLOCK_MONOTONIC on Linux, as servers' `time.monotonic()` stamps)."""
    rng = np.random.default_rng(load.seed)
    lengths = workload.sample(load.num_requests, rng)
    prompts = [make_prompt(i, rng) for i, _ in lengths]
    records = [RequestRecord(n, i, o) for n, (i, o) in enumerate(lengths)]
    bar = tqdm(total=len(records), desc="bench", disable=not progress)
    connector = aiohttp.TCPConnector(limit=0)   # concurrency is ours to set, not the connector's
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()

        async def one(n: int) -> None:
            await send(session, endpoint, records[n], prompts[n], t0, load.timeout)
            bar.update(1)

        if load.concurrency is not None:
            await _closed_loop(one, len(records), load, t0)
        else:
            await _open_loop(one, arrival_times(len(records), load.rate, load.burstiness, rng),
                             load, t0)
    bar.close()
    sent = [r for r in records if r.e2e is not None or r.error]
    end = max((r.start + (r.e2e or 0.0) for r in sent), default=0.0)
    return sent, max(end - min((r.start for r in sent), default=0.0), 1e-9), t0


async def _open_loop(one, arrivals: np.ndarray, load: LoadSettings, t0: float) -> None:
    """Start request n at arrivals[n], whether or not earlier ones have finished."""
    tasks = []
    for n, at in enumerate(arrivals):
        if at > load.max_duration:
            break
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)


async def _closed_loop(one, total: int, load: LoadSettings, t0: float) -> None:
    """`concurrency` workers, each sending its next request when its last one ends."""
    counter = iter(range(total))

    async def worker() -> None:
        for n in counter:
            if time.perf_counter() - t0 > load.max_duration:
                return
            await one(n)

    await asyncio.gather(*(worker() for _ in range(min(load.concurrency, total))))


def check_load(load: LoadSettings) -> None:
    """Clear errors for settings that cannot run."""
    if (load.rate is None) == (load.concurrency is None):
        raise ValueError("give exactly one of --rate and --concurrency")
    if load.rate is not None and not (load.rate > 0 or math.isinf(load.rate)):
        raise ValueError(f"--rate: must be > 0 (or inf), got {load.rate}")
    if load.concurrency is not None and load.concurrency < 1:
        raise ValueError(f"--concurrency: must be >= 1, got {load.concurrency}")
    for name in ("num_requests", "timeout", "max_duration", "burstiness"):
        if not getattr(load, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
