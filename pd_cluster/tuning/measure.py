"""Measure prefill and decode step latency through the engine on this machine.

Prefill points are sets of prompts prefilled in one engine step (so Σl and Σl² vary apart);
decode points are batches of sequences at a context length. Decode sequences enter the way
they do on a decode instance of a disaggregated cluster: `reserve` + `resume`, which skips
computing their prompts (their KV content does not change a step's time), so large batches at
long contexts cost only the decode steps themselves. Every point is measured once per pass,
passes visit the points in a fresh random order, and a point's time is the median over passes:
a burst of load from elsewhere on the machine then lands on different points each pass.
"""
from __future__ import annotations

import datetime
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pd_cluster.config import DEFAULT_MODEL, EngineConfig
from pd_cluster.engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tuning.profile import (DECODE_FEATURES, PREFILL_FEATURES, LatencyModel,
                                       Profile, Sample, decode_features, kv_bytes_per_token,
                                       prefill_features)

# Token ids drawn for prompts stay clear of special tokens at the bottom of the vocabulary.
_FIRST_ID = 100


@dataclass(slots=True)
class ProfileGrid:
    """Which points to measure, how often, and which share to hold back for checking the fit."""

    prefill_tokens: tuple[int, ...]      # Σl of a prefill step
    prefill_splits: tuple[int, ...]      # number of equal prompts Σl is split into
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]     # context length of every sequence in the batch
    passes: int = 3                      # each point measured once per pass; median taken
    decode_steps: int = 3                # timed decode steps per point and pass
    held_out_fraction: float = 0.2
    seed: int = 0

    def prefill_points(self) -> list[tuple[int, ...]]:
        """Prompt length lists; a split is skipped where its prompts would be under 8 tokens."""
        return [tuple([total // n] * n) for total in self.prefill_tokens
                for n in self.prefill_splits if total // n >= 8]

    def decode_points(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.decode_batches for c in self.decode_contexts]


def default_grid(device: str) -> ProfileGrid:
    """A grid sized for the device: seconds-long CPU steps, or a GPU's much larger range."""
    if device == "cpu":
        return ProfileGrid((16, 32, 64, 128, 192, 256, 384, 512), (1, 2, 4),
                           (1, 2, 4, 8, 16), (64, 128, 256, 512))
    return ProfileGrid((64, 128, 256, 512, 1024, 2048, 4096, 8192), (1, 2, 4, 8),
                       (1, 4, 16, 32, 64, 128, 256), (256, 1024, 2048, 4096), passes=5,
                       decode_steps=5)


def run_profile(model: str | None = None, dtype: str = "auto", device: str = "auto",
                grid: ProfileGrid | None = None, threads: int | None = None,
                progress: bool = True, load_format: str = "auto",
                tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto") -> Profile:
    """Measure the grid through an engine on this machine and fit both latency models.

    `threads`: torch CPU threads; None keeps torch's choice on a GPU and uses 1 on a CPU.
    `tensor_parallel_size`: GPUs of the engine measured (the profile holds it; `tune` counts
    that many GPUs per instance). `kv_cache_dtype`: the engine's (auto or fp8); the profile
    records it, and its KV bytes per token and KV capacity are that dtype's.
    """
    model = DEFAULT_MODEL if model is None else model
    probe = EngineConfig(model=model, dtype=dtype, device=device, load_format=load_format)
    device_type = probe.torch_device().type
    grid = grid or default_grid(device_type)
    if threads is None and device_type == "cpu":
        # One thread: on cores shared with other work, multi-threaded steps wait at every
        # barrier for a descheduled sibling and their times scatter by 10x; one thread is
        # also what Ray gives a replica that holds a fraction of a CPU (OMP_NUM_THREADS=1).
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    # On a CPU with one thread the clock is this process's CPU time: on a core of its own
    # that equals the wall time, and unlike the wall time it leaves out the time other
    # processes held the core. Otherwise (a GPU, or several threads) it is the wall time.
    cpu_clock = device_type == "cpu" and torch.get_num_threads() == 1
    clock = time.process_time if cpu_clock else time.perf_counter
    budget = max(max(map(sum, grid.prefill_points())), max(grid.decode_batches))
    longest = max(max(grid.prefill_tokens), max(grid.decode_contexts)) + grid.decode_steps + 8
    config = EngineConfig(model=model, dtype=dtype, device=device, load_format=load_format,
                          max_num_batched_tokens=budget, max_num_seqs=max(grid.decode_batches),
                          max_model_len=longest, enable_prefix_caching=False,
                          tensor_parallel_size=tensor_parallel_size,
                          kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(config)
    try:
        prefill, decode = _measure(engine, grid, clock, progress)
    finally:
        engine.close()
    machine = {**machine_info(engine), "clock": "process_cpu_time" if cpu_clock else "wall"}
    return Profile(machine=machine, model=model_info(engine),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   engine={"block_size": config.block_size,
                           "kv_capacity_tokens": engine.kv.num_blocks * config.block_size,
                           "max_num_batched_tokens": config.max_num_batched_tokens,
                           "tensor_parallel_size": tensor_parallel_size,
                           "kv_cache_dtype": kv_cache_dtype},
                   prefill=LatencyModel.fit(PREFILL_FEATURES, prefill),
                   decode=LatencyModel.fit(DECODE_FEATURES, decode))


def _measure(engine: LLMEngine, grid: ProfileGrid, clock: Callable[[], float],
             progress: bool) -> tuple[list[Sample], list[Sample]]:
    rng = random.Random(grid.seed)
    vocab = engine.model_cfg.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(_FIRST_ID, vocab) for _ in range(n)]

    for _ in range(2):      # warm-up: first calls allocate and pick kernels
        _prefill_step(engine, [prompt(16)] * 2, clock)
        _decode_steps(engine, [prompt(64)] * 2, 1, rng, clock)
    prefill_points = grid.prefill_points()
    # A decode point must fit in the KV cache, with room for the tokens its steps add.
    decode_points = [(b, c) for b, c in grid.decode_points() if b * engine.kv.blocks_needed(
        c + grid.decode_steps + 4) <= engine.kv.num_blocks]
    prefill_times: dict[int, list[float]] = {i: [] for i in range(len(prefill_points))}
    decode_times: dict[int, list[float]] = {i: [] for i in range(len(decode_points))}
    jobs = ([("p", i) for i in prefill_times] + [("d", i) for i in decode_times])
    bar = tqdm(total=grid.passes * len(jobs), desc="profile", disable=not progress)
    for _ in range(grid.passes):
        rng.shuffle(jobs)
        for kind, i in jobs:
            if kind == "p":
                prefill_times[i].append(_prefill_step(
                    engine, [prompt(n) for n in prefill_points[i]], clock))
            else:
                batch, ctx = decode_points[i]
                decode_times[i] += _decode_steps(engine, [prompt(ctx) for _ in range(batch)],
                                                 grid.decode_steps, rng, clock)
            bar.update(1)
    bar.close()
    prefill = [Sample(prefill_features(p), _median(prefill_times[i]),
                      shape={"lengths": list(p)}) for i, p in enumerate(prefill_points)]
    # Context grows by one per timed step; the middle step's context stands for them all.
    mid = 1 + grid.decode_steps // 2
    decode = [Sample(decode_features(b, b * (c + mid)), _median(decode_times[i]),
                     shape={"batch": b, "context": c}) for i, (b, c) in enumerate(decode_points)]
    _hold_out(prefill, grid.held_out_fraction, rng)
    _hold_out(decode, grid.held_out_fraction, rng)
    return prefill, decode


def _prefill_step(engine: LLMEngine, prompts: list[list[int]],
                  clock: Callable[[], float]) -> float:
    """Seconds of one engine step prefilling all `prompts` (each then finishes at once)."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1))
    start = clock()
    engine.step()
    _sync(engine)
    seconds = clock() - start
    engine.step()   # reports the step (with async scheduling it is reported by the next call)
    if engine.has_unfinished():
        raise RuntimeError("a prefill point did not fit in one engine step")
    return seconds


def _decode_steps(engine: LLMEngine, prompts: list[list[int]], steps: int,
                  rng: random.Random, clock: Callable[[], float]) -> list[float]:
    """Seconds per decode step over a batch whose prompts' KV is taken as written, timed over
    `steps` back-to-back steps: with async scheduling the host's work for one step overlaps
    the device's work on the previous one, as in serving."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = []
    for p in prompts:
        reserved = engine.reserve(p, params)
        if reserved is None:
            raise RuntimeError("the KV cache is too small for a decode point; shrink the grid")
        ids.append(reserved[0])
        engine.resume(reserved[0], rng.randrange(_FIRST_ID, engine.model_cfg.vocab_size))
    _sync(engine)
    start = clock()
    for _ in range(steps):
        engine.step()
    _sync(engine)
    seconds = (clock() - start) / steps
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():   # the aborted requests' step still in flight
        engine.step()
    return [seconds]


def _sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _hold_out(samples: list[Sample], fraction: float, rng: random.Random) -> None:
    """Mark a random `fraction` of the samples (at least one) as held back from the fit."""
    count = max(1, round(fraction * len(samples))) if fraction > 0 else 0
    for s in rng.sample(samples, count):
        s.held_out = True


def machine_info(engine: LLMEngine) -> dict[str, object]:
    device = engine.runner.device
    return {"platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_info(engine: LLMEngine) -> dict[str, object]:
    """The model's shape and dtypes; KV bytes per token in the KV cache's dtype (fp8: one
    byte an element)."""
    m, dtype, kv_dtype = engine.model_cfg, engine.runner.dtype, engine.runner.kv_dtype
    return {"name": os.path.basename(os.path.normpath(engine.model_dir)),
            "architecture": m.architecture, "num_layers": m.num_layers,
            "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "hidden_size": m.hidden_size, "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim,
                                                     kv_dtype.itemsize, m.kv_parts)}
