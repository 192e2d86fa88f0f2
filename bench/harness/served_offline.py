"""Served against offline throughput on the same engine (`python -m bench.served_vs_offline`):
the workload, the HTTP client, the summaries and the CPU meter. No Ray here: the command line
serves the app (bench/serving_bench.py) and calls the engine actor's `run_offline`.

The workload: N requests, C at a time (closed loop: a new one starts when one finishes),
prompts of P random token ids (no special ids) sent as token-id prompts to /v1/completions,
max_tokens T, ignore_eos, temperature 0, streamed. Every phase (served, offline, and each
warm-up) gets its own first token on the same prompts, so that with chained block hashes no
phase finds another's blocks in the prefix cache, and each prompt differs from the others.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

DEFINITIONS = {
    "tok_s": "output tokens of the completed requests / the phase's wall time (first send to "
             "last completion; closed loop, so ramp-up and drain are inside it)",
    "ttft": "send to the first chunk with a choice (served: the first SSE chunk with text or a "
            "finish reason; offline: the first engine output carrying tokens)",
    "itl": "gaps between successive chunks of a request (served: SSE chunks with a choice; "
           "offline: the engine outputs the consumer saw). A chunk carries one token unless "
           "the consumer fell behind and outputs were folded into one, so these are chunk gaps, "
           "not per-token gaps; tokens_per_chunk says how many tokens a chunk carried on "
           "average, and tpot is the per-token figure",
    "tpot": "per request (last chunk - first chunk) / (tokens - 1)",
    "cpu_cores": "CPU seconds (user + system, all threads) a process used during the phase / "
                 "the phase's wall time; busiest_threads: the same for its three busiest "
                 "threads (a thread near 1.0 is saturated)",
    "engine_steps": "the engine's step counters over the phase (ReplicaLoad.steps deltas): "
                    "steps and seconds per kind, decode sequences per decode/mixed step, "
                    "busy = step seconds / wall",
    "ratio": "served tok_s / offline tok_s",
}


# -- the workload ---------------------------------------------------------------------------------

def random_prompts(n: int, length: int, vocab_size: int, special_ids: Iterable[int],
                   seed: int) -> list[list[int]]:
    """`n` prompts of `length` ids drawn uniformly from [0, vocab_size) less `special_ids`."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
    rng = np.random.default_rng(seed)
    return rng.choice(allowed, size=(n, length)).tolist()


def with_first_token(prompts: list[list[int]], token: int) -> list[list[int]]:
    """The prompts with their first id set to `token` (one per phase: see the docstring)."""
    return [[token, *p[1:]] for p in prompts]


def phase_tokens(prompts: list[list[int]], count: int) -> list[int]:
    """`count` distinct ids to open each phase's prompts with (taken among the prompts' own
    ids, so they are allowed ones)."""
    ids = sorted({t for p in prompts for t in p})
    if len(ids) < count:
        raise ValueError(f"the prompts hold {len(ids)} distinct ids, fewer than {count} phases")
    return ids[:count]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


# -- one request's record and a phase's summary ---------------------------------------------------

@dataclass(slots=True)
class Record:
    ok: bool = False
    error: str = ""
    ttft: float | None = None      # seconds
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0
    e2e: float | None = None       # send to the last chunk with a choice

    @classmethod
    def of_offline(cls, row: Mapping) -> Record:
        gaps = list(row["gaps"])
        return cls(ok=row["ttft"] is not None, ttft=row["ttft"], gaps=gaps,
                   tokens=row["tokens"], chunks=len(gaps) + (row["ttft"] is not None),
                   e2e=row["e2e"], error="" if row["ttft"] is not None else "no tokens")


def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = 1000 * np.asarray(values, dtype=float)
    return {"p50": round(float(np.percentile(a, 50)), 3),
            "p90": round(float(np.percentile(a, 90)), 3),
            "p99": round(float(np.percentile(a, 99)), 3), "mean": round(float(a.mean()), 3)}


def summarize(records: list[Record], seconds: float, max_tokens: int,
              errors: list[str] = ()) -> dict:
    """A phase's throughput, latencies (ms) and failures."""
    done = [r for r in records if r.ok]
    tokens = sum(r.tokens for r in done)
    chunks = sum(r.chunks for r in done)
    ttft, itl = _ms([r.ttft for r in done]), _ms([g for r in done for g in r.gaps])
    tpot = _ms([(r.e2e - r.ttft) / (r.tokens - 1) for r in done if r.tokens > 1])
    failed = [r.error for r in records if not r.ok]
    return {"tok_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "seconds": round(seconds, 3), "requests": len(records), "completed": len(done),
            "errors": len(failed), "error_messages": sorted(set(failed) | set(errors))[:10],
            "output_tokens": tokens,
            "exact_length": sum(r.tokens == max_tokens for r in done),
            "tokens_per_chunk": round(tokens / chunks, 3) if chunks else None,
            "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
            "itl_p50_ms": itl["p50"], "itl_p99_ms": itl["p99"],
            "tpot_p50_ms": tpot["p50"], "tpot_p99_ms": tpot["p99"],
            "ttft_ms": ttft, "itl_ms": itl, "tpot_ms": tpot}


def pooled(phases: list[tuple[list[Record], float]], max_tokens: int) -> dict:
    """Several rounds of one phase as one: their records together over their summed time."""
    return summarize([r for records, _ in phases for r in records],
                     sum(s for _, s in phases), max_tokens)


# -- the served phase: streamed HTTP requests, closed loop ----------------------------------------

async def _request(session, url: str, body: bytes, rec: Record) -> None:
    sent = time.perf_counter()
    last = None
    async with session.post(url, data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:          # one SSE line at a time
            if not raw.startswith(b"data: {"):   # blank lines, data: [DONE]
                continue
            now = time.perf_counter()
            data = json.loads(raw[6:])
            if "error" in data:                  # an error after the 200 went out
                raise RuntimeError(f"error event: {json.dumps(data['error'])[:300]}")
            if data.get("choices"):
                if last is None:
                    rec.ttft = now - sent
                else:
                    rec.gaps.append(now - last)
                last = now
                rec.chunks += 1
            if data.get("usage"):
                rec.tokens = data["usage"].get("completion_tokens") or 0
    if last is None:
        raise RuntimeError("the stream carried no choice")
    rec.e2e = last - sent
    rec.ok = True


async def _closed_loop(session, url: str, bodies: list[bytes], records: list[Record],
                       concurrency: int, timeout_s: float) -> None:
    """Fill `records` (one per body), `concurrency` requests at a time."""
    todo = iter(range(len(bodies)))

    async def worker() -> None:
        for i in todo:                      # one iterator shared by all workers
            rec = records[i]
            try:
                await asyncio.wait_for(_request(session, url, bodies[i], rec), timeout_s)
            except asyncio.TimeoutError:
                rec.error = f"timed out after {timeout_s:g} s"
            except Exception as e:  # noqa: BLE001 - counted and reported, not hidden
                rec.error = f"{type(e).__name__}: {e}"[:300]
            if rec.error:
                rec.ok = False

    await asyncio.gather(*[worker() for _ in range(max(1, min(concurrency, len(bodies))))])


async def served_phase(url: str, bodies: list[bytes], concurrency: int, timeout_s: float,
                       phase_timeout_s: float, warmup: list[bytes] = (),
                       on_start=None) -> tuple[list[Record], float, list[Record]]:
    """Warm-up requests (unmeasured, `concurrency` at a time at most), then the measured
    closed loop. Returns the measured records, the measured wall seconds and the warm-up's
    records. `on_start()` runs right before the measured sends (starts the CPU meter). A
    loop that runs past `phase_timeout_s` is cancelled; its unfinished requests count as
    failed."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    endpoint = f"{url}/v1/completions"
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        warm = [Record() for _ in warmup]
        await _bounded(_closed_loop(session, endpoint, list(warmup), warm, concurrency,
                                    timeout_s), warm, phase_timeout_s)
        if on_start is not None:
            on_start()
        records = [Record() for _ in bodies]
        start = time.perf_counter()
        await _bounded(_closed_loop(session, endpoint, bodies, records, concurrency,
                                    timeout_s), records, phase_timeout_s)
        return records, time.perf_counter() - start, warm


async def _bounded(loop, records: list[Record], timeout_s: float) -> None:
    try:
        await asyncio.wait_for(loop, timeout_s)
    except asyncio.TimeoutError:
        for rec in records:
            if not rec.ok and not rec.error:
                rec.error = f"not finished when the phase ran past {timeout_s:g} s"


# -- CPU use of the processes involved ------------------------------------------------------------

class CpuMeter:
    """CPU seconds of labelled processes between `start` and `stop`, as cores."""

    def __init__(self, pids: Mapping[str, list[int]]) -> None:
        import psutil

        self.procs: dict[str, list] = {}
        for label, group in pids.items():
            self.procs[label] = []
            for pid in group:
                try:
                    self.procs[label].append(psutil.Process(pid))
                except psutil.Error:
                    pass
        self.before: dict[int, tuple[float, dict[int, float]]] = {}
        self.began = 0.0

    @staticmethod
    def _sample(proc) -> tuple[float, dict[int, float]] | None:
        import psutil

        try:
            t = proc.cpu_times()
            threads = {th.id: th.user_time + th.system_time for th in proc.threads()}
            return t.user + t.system, threads
        except psutil.Error:
            return None

    def start(self) -> None:
        self.began = time.perf_counter()
        self.before = {p.pid: s for ps in self.procs.values() for p in ps
                       if (s := self._sample(p)) is not None}

    def stop(self) -> dict[str, dict]:
        wall = time.perf_counter() - self.began
        out = {}
        for label, procs in self.procs.items():
            cores, threads, pids = 0.0, [], []
            for p in procs:
                after, before = self._sample(p), self.before.get(p.pid)
                if after is None or before is None:
                    continue
                pids.append(p.pid)
                cores += (after[0] - before[0]) / wall
                threads += [(t - before[1].get(tid, 0.0)) / wall for tid, t in after[1].items()]
            out[label] = {"cores": round(cores, 3), "processes": len(pids),
                          "busiest_threads": [round(c, 3) for c in sorted(threads)[::-1][:3]]}
        return out


def haproxy_pids(root_pids: Iterable[int]) -> list[int]:
    """HAProxy processes under any of `root_pids`: Serve's HAProxyManager (the proxy actor)
    runs HAProxy in the foreground as its child."""
    import psutil

    found = set()
    for pid in root_pids:
        try:
            for child in psutil.Process(pid).children(recursive=True):
                if child.name().startswith("haproxy"):
                    found.add(child.pid)
        except psutil.Error:
            continue
    return sorted(found)


def machine() -> dict:
    """GPU name (torch, else nvidia-smi) or "cpu", CPU count."""
    gpu = "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a description only
        pass
    import platform
    return {"gpu": gpu, "cpus": os.cpu_count(), "python": platform.python_version()}
