"""Discrete-event simulation of a pd-cluster deployment serving one workload.

Disaggregated, as in push mode (README, "How a request is served"):
    arrival → router reserves the whole request's KV on the decode instance with the most room
    left (or waits, FIFO, until one has room) and queues the prompt on the prefill instance
    with the fewest queued tokens → prefill steps batch prompts FIFO up to a token budget,
    chunking a long one → its last chunk emits the first token (TTFT) → KV moves over the
    decode instance's link (bytes / bandwidth, one transfer at a time) → the request joins the
    decode instance's continuous batch at its next step → finish frees its KV.
Colocated: the router queues a request on the engine with the least work; each engine step
runs its decodes first, then fills the rest of the token budget with prefill chunks.

Step times come from the profile's fitted models. Counts are simulated, contents are not.
The profile's serving overhead (HTTP, router, Ray calls; measured, a function of the prompt
length) is added to each request's TTFT and end-to-end time, so TPOT keeps the engine's.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np

from pd_cluster.tuning.profile import Profile
from pd_cluster.tuning.slo import SLO


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A candidate deployment: P prefill + D decode instances, or D colocated engines, each of
    `gpus_per_instance` GPUs (the profiled engine's tensor-parallel size)."""

    num_prefill: int
    num_decode: int
    gpus_per_instance: int = 1

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_gpus(self) -> int:
        return (self.num_prefill + self.num_decode) * self.gpus_per_instance

    def __str__(self) -> str:
        name = f"colocated x{self.num_decode}" if self.colocated else \
            f"{self.num_prefill}P{self.num_decode}D"
        return name if self.gpus_per_instance == 1 else f"{name} TP{self.gpus_per_instance}"


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Per-instance engine settings and the hardware numbers the profile does not hold."""

    kv_capacity_tokens: int
    kv_bandwidth: float                 # bytes/s into one decode instance
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256


@dataclass(slots=True)
class SimRequest:
    """One request's lengths and the times the simulation gives it."""

    index: int
    arrival: float
    input_len: int
    output_len: int
    first_token: float = math.nan
    finish: float = math.nan
    prefilled: int = 0                  # prompt tokens computed so far
    home: int = -1                      # its decode instance (or colocated engine)
    overhead: float = 0.0               # serving path outside the engine, seconds

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival + self.overhead

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / max(1, self.output_len - 1)


@dataclass(slots=True)
class SimResult:
    """Per-request latencies of the measured requests of one run (in arrival order)."""

    spec: ClusterSpec
    rate: float
    ttft: np.ndarray
    tpot: np.ndarray

    def met_fraction(self, slo: SLO) -> float:
        return float(np.mean((self.ttft <= slo.ttft) & (self.tpot <= slo.tpot)))

    def goodput(self, slo: SLO) -> float:
        """Requests/s that met both objectives; 0 when fewer than the percentile did."""
        met = self.met_fraction(slo)
        return met * self.rate if slo.attained(met) else 0.0


class EventKind(Enum):
    ARRIVAL = "arrival"                 # target: request index
    STEP_DONE = "step_done"             # target: instance index in Simulator.instances
    KV_LANDED = "kv_landed"             # target: request index


class Event(NamedTuple):
    """Heap order is (time, seq), seq unique: kind and target are never compared. A tuple, not
    an ordered dataclass: the heap compares in C, and a replay makes millions of comparisons."""
    time: float
    seq: int                            # FIFO among equal times
    kind: EventKind
    target: int


class _Batch:
    """Continuous decode batch. Each step adds one token to every member, so instead of
    touching every member per step it keeps Σctx and a heap of finishing step numbers."""

    def __init__(self) -> None:
        self.size, self.sum_ctx, self.steps = 0, 0, 0
        self._ends: list[tuple[int, int, SimRequest]] = []
        self._ids = itertools.count()

    def join(self, req: SimRequest) -> None:
        self.size += 1
        self.sum_ctx += req.input_len + 1
        heapq.heappush(self._ends, (self.steps + req.output_len - 1, next(self._ids), req))

    def advance(self) -> list[SimRequest]:
        """One step done: returns the requests that reached their output length."""
        self.steps += 1
        self.sum_ctx += self.size
        done = []
        while self._ends and self._ends[0][0] <= self.steps:
            req = heapq.heappop(self._ends)[2]
            self.size -= 1
            self.sum_ctx -= req.input_len + req.output_len
            done.append(req)
        return done


class Instance:
    """One engine: a prefill queue (P), a decode batch (D), or both (colocated)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: deque[SimRequest] = deque()     # prompts waiting for (more) prefill
        self.queued_tokens = 0
        self.batch = _Batch()
        self.landed: list[SimRequest] = []          # KV arrived, joins at the next step
        self.chunks: list[tuple[SimRequest, int]] = []   # prefill chunks of the running step
        self.reserved = 0                           # KV tokens held by its requests
        self.link_free = 0.0                        # when its incoming KV link frees up
        self.busy = False

    def plan_step(self, profile: Profile, limits: EngineLimits) -> float | None:
        """Start a step: admit landed requests, pick prefill chunks; its duration or None."""
        room = limits.max_num_seqs - self.batch.size
        joining, self.landed = self.landed[:room], self.landed[room:]
        for req in joining:
            self.batch.join(req)
        budget = limits.max_num_batched_tokens - self.batch.size
        seats = limits.max_num_seqs - self.batch.size
        sum_c, sum_sq, self.chunks = 0, 0, []
        for req in self.queue:
            if budget <= 0 or seats <= 0:
                break
            c = min(budget, req.input_len - req.prefilled)
            # Attention work of a chunk after p computed tokens: (p + c)^2 - p^2, so the
            # chunks of one prompt add up to the l^2 of prefilling it whole.
            sum_c, sum_sq = sum_c + c, sum_sq + c * (2 * req.prefilled + c)
            self.chunks.append((req, c))
            budget, seats = budget - c, seats - 1
        if not self.chunks and not self.batch.size:
            return None
        seconds = 0.0
        if self.chunks:
            seconds += profile.prefill_time(sum_c, sum_sq)
        if self.batch.size:
            seconds += profile.decode_time(self.batch.size, self.batch.sum_ctx)
            if self.chunks:     # one forward pass: its fixed cost is paid once, not twice
                seconds -= min(profile.prefill.coef[-1], profile.decode.coef[-1])
        return seconds

    def finish_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """End the step: returns (prompts that got their first token, requests finished)."""
        prefilled = []
        for req, c in self.chunks:
            req.prefilled += c
            self.queued_tokens -= c
            if req.prefilled == req.input_len:
                self.queue.popleft()        # chunks are taken from the head, in order
                req.first_token = now
                prefilled.append(req)
        self.chunks = []
        finished = self.batch.advance() if self.batch.size else []
        return prefilled, finished


def overhead_quantile(n: int) -> float:
    """Which quantile of the measured serving overhead request n gets: the golden-ratio
    sequence, which covers (0, 1) evenly over any run of requests without a random draw, so
    runs stay reproducible and compare like for like."""
    return (0.5 + n * 0.6180339887498949) % 1.0


class Simulator:
    """Runs one ClusterSpec over a list of requests; `run()` returns the SimResult."""

    def __init__(self, profile: Profile, limits: EngineLimits, spec: ClusterSpec) -> None:
        self.profile, self.limits, self.spec = profile, limits, spec
        self.decoders = [Instance(i) for i in range(spec.num_decode)]
        self.prefillers = [Instance(spec.num_decode + i) for i in range(spec.num_prefill)]
        self.instances = self.decoders + self.prefillers
        self.events: list[Event] = []
        self.waiting: deque[SimRequest] = deque()     # no decode instance has room yet
        self.requests: list[SimRequest] = []
        self._seq = itertools.count()

    def run(self, lengths: list[tuple[int, int]], arrivals: np.ndarray, rate: float,
            measured: slice = slice(None)) -> SimResult:
        """Simulate every request; report those in `measured` (the rest warm up and keep
        the load on while the measured ones finish)."""
        too_long = max(i + o for i, o in lengths)
        if too_long > self.limits.kv_capacity_tokens:
            raise ValueError(f"a request of {too_long} tokens exceeds the KV capacity of "
                             f"{self.limits.kv_capacity_tokens} tokens per instance")
        self.requests = [SimRequest(n, float(t), i, o,
                                    overhead=self.profile.overhead_time(i, overhead_quantile(n)))
                         for n, (t, (i, o)) in enumerate(zip(arrivals, lengths))]
        for req in self.requests:
            self._push(req.arrival, EventKind.ARRIVAL, req.index)
        while self.events:
            event = heapq.heappop(self.events)
            if event.kind is EventKind.ARRIVAL:
                self.waiting.append(self.requests[event.target])
                self._admit(event.time)
            elif event.kind is EventKind.KV_LANDED:
                self._land(self.requests[event.target], event.time)
            else:
                self._step_done(self.instances[event.target], event.time)
        reqs = self.requests[measured]
        return SimResult(self.spec, rate, np.array([r.ttft for r in reqs]),
                         np.array([r.tpot for r in reqs]))

    def _push(self, time: float, kind: EventKind, target: int) -> None:
        heapq.heappush(self.events, Event(time, next(self._seq), kind, target))

    def _admit(self, now: float) -> None:
        """Route waiting requests, in order, while a decode instance has room for the next."""
        capacity = self.limits.kv_capacity_tokens
        while self.waiting:
            req = self.waiting[0]
            need = req.input_len + req.output_len
            home = min(self.decoders, key=lambda d: d.reserved + d.queued_tokens)
            if home.reserved + need > capacity:
                home = next((d for d in self.decoders if d.reserved + need <= capacity), None)
                if home is None:
                    return
            self.waiting.popleft()
            home.reserved += need
            req.home = home.index
            prefiller = home if self.spec.colocated else \
                min(self.prefillers, key=lambda p: p.queued_tokens)
            prefiller.queue.append(req)
            prefiller.queued_tokens += req.input_len
            self._kick(prefiller, now)

    def _kick(self, instance: Instance, now: float) -> None:
        """Start a step on an idle instance that has work."""
        if instance.busy:
            return
        seconds = instance.plan_step(self.profile, self.limits)
        if seconds is not None:
            instance.busy = True
            self._push(now + seconds, EventKind.STEP_DONE, instance.index)

    def _step_done(self, instance: Instance, now: float) -> None:
        instance.busy = False
        prefilled, finished = instance.finish_step(now)
        for req in prefilled:
            if req.output_len <= 1:
                finished.append(req)
            elif self.spec.colocated:
                instance.landed.append(req)
            else:
                self._send_kv(req, now)
        for req in finished:
            req.finish = now
            self.decoders[req.home].reserved -= req.input_len + req.output_len
        self._kick(instance, now)
        if finished:
            self._admit(now)

    def _send_kv(self, req: SimRequest, now: float) -> None:
        """Push the prompt's KV to its decode instance over that instance's link."""
        home = self.decoders[req.home]
        seconds = req.input_len * self.profile.kv_bytes_per_token / self.limits.kv_bandwidth
        home.link_free = max(now, home.link_free) + seconds
        self._push(home.link_free, EventKind.KV_LANDED, req.index)

    def _land(self, req: SimRequest, now: float) -> None:
        home = self.decoders[req.home]
        home.landed.append(req)
        self._kick(home, now)
