"""PlannerLoop: the P:D planner (pd_cluster/planner.py) applied to an application's live
tiers, inside the engine controller.

    report(samples)     router replicas send what they measured of each finished request
                        (LatencySample: TTFT, TPOT, lengths), every REPORT_EVERY_S
    every interval_s    the interval's samples → TTFT and TPOT at the SLO percentile, the tier
                        sizes (the fleet's targets) and the engines' own load (queues, KV use,
                        from the health checks) → one Decision, logged with its inputs
                        (PlanRecord) and counted by action. While a change is still being made
                        the decision is HOLD; with a profile, a removal is first simulated on
                        the interval's requests (pd_cluster/tuning/replay.py)
    a decision          ADD_x: EngineFleet.add (Ray places the actor; with an autoscaler a
                        node is added when none has room) | REMOVE_x: the least busy READY
                        replica of x drains (routers stop sending it work, it finishes what it
                        has) and stops | FLIP_TO_x: the least busy replica of the other role
                        drains and changes roles, its model kept loaded (EngineFleet.flip)
No request fails because of a change: nothing is stopped or switched before it is idle.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pd_cluster.planner import Action, Decision, IntervalStats, Planner, PlannerSettings, Predict
from pd_cluster.role import Role
from router.control.fleet import EngineFleet
from router.control.membership import ReplicaState

logger = logging.getLogger(__name__)
REPORT_EVERY_S = 1.0          # how often a router replica sends its samples
MAX_SAMPLES = 100_000         # per interval; beyond it the oldest are dropped
LOG_LENGTH = 512              # decisions kept for `planner_log`


@dataclass(frozen=True, slots=True)
class LatencySample:
    """One finished request as its router saw it."""

    arrived: float              # wall clock (time.time()) when the router admitted it
    ttft: float                 # seconds
    tpot: float                 # seconds per output token after the first; nan with one token
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """One interval's decision and what it was made from."""

    at: float                                   # wall clock
    action: str
    reason: str
    stats: dict[str, Any]                       # IntervalStats' fields
    loads: dict[Role, dict[str, float]] = field(default_factory=dict)  # per role, its engines
    applied: str = ""                           # what the change did, once done


@dataclass(frozen=True, slots=True)
class PlannerView:
    """What routers export of the planner (router/metrics.py)."""

    enabled: bool
    decisions: dict[str, int]                   # action → count since the controller started
    last: PlanRecord | None = None


class PlannerLoop:
    """See the module docstring. `predictor(arrivals, lengths)` → a Predict for the
    interval's requests (None: removals are not vetted)."""

    def __init__(self, fleet: EngineFleet, settings: PlannerSettings, percentile: float,
                 interval_s: float, drain_timeout_s: float, predictor: Any = None) -> None:
        self.fleet, self.settings, self.percentile = fleet, settings, percentile
        self.interval_s, self.drain_timeout_s, self.predictor = (interval_s, drain_timeout_s,
                                                                 predictor)
        self.planner = Planner(settings)
        self.counts: collections.Counter[str] = collections.Counter()
        self.log: collections.deque[PlanRecord] = collections.deque(maxlen=LOG_LENGTH)
        self._samples: collections.deque[LatencySample] = collections.deque(maxlen=MAX_SAMPLES)
        self._change: asyncio.Task | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def for_app(cls, config: Any, engine: Any, fleet: EngineFleet) -> PlannerLoop:
        """The planner of an application's config (AppConfig, planner enabled) over its
        fleet; `engine`: the replicas' EngineConfig (for a profile's simulated limits)."""
        p = config.planner
        settings = config.planner_settings()
        return cls(fleet, settings, p.percentile, p.interval_s, p.drain_timeout_s,
                   profile_predictor(p.profile, settings, p.percentile, engine)
                   if p.profile else None)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        for task in (self._task, self._change):
            if task is not None:
                task.cancel()

    def report(self, samples: list[LatencySample]) -> PlannerView:
        self._samples.extend(samples)
        return self.view()

    def view(self) -> PlannerView:
        return PlannerView(True, dict(self.counts), self.log[-1] if self.log else None)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad interval
                logger.exception("planner interval failed")

    def tick(self, now: float | None = None) -> PlanRecord:
        """Decide on the samples since the last tick, and start the change (if any)."""
        now = time.monotonic() if now is None else now
        samples, self._samples = list(self._samples), collections.deque(maxlen=MAX_SAMPLES)
        loads = self._loads()
        stats = self._stats(samples, loads)
        if self._change is not None and not self._change.done():
            decision = Decision(Action.HOLD, "the last change is still being made", stats)
        else:
            self.planner.predict = self._predict(samples)
            decision = self.planner.decide(stats, now)
        record = PlanRecord(time.time(), str(decision.action), decision.reason,
                            {k: getattr(stats, k) for k in IntervalStats.__slots__}, loads)
        self.counts[record.action] += 1
        self.log.append(record)
        logger.info("planner: %s: %s", record.action, record.reason)
        if decision.action is not Action.HOLD:
            self._change = asyncio.get_running_loop().create_task(self._apply(decision.action))
        return record

    def _stats(self, samples: list[LatencySample], loads: dict[Role, dict[str, float]]
               ) -> IntervalStats:
        p, d = (self.fleet.targets.get(Role.PREFILL, 0), self.fleet.targets.get(Role.DECODE, 0))
        tier = lambda role, key: loads.get(role, {}).get(key, math.nan)  # noqa: E731
        engines = dict(prefill_waiting=tier(Role.PREFILL, "waiting"),
                       decode_waiting=tier(Role.DECODE, "waiting"),
                       prefill_kv_usage=tier(Role.PREFILL, "kv_usage"),
                       decode_kv_usage=tier(Role.DECODE, "kv_usage"))
        if not samples:
            return IntervalStats(p, d, math.nan, math.nan, 0, **engines)
        tpots = [s.tpot for s in samples if not math.isnan(s.tpot)]
        # Requests of one token have no TPOT: they put no load on decode to measure.
        return IntervalStats(p, d, float(np.percentile([s.ttft for s in samples],
                                                       self.percentile)),
                             float(np.percentile(tpots, self.percentile)) if tpots else 0.0,
                             len(samples), **engines)

    def _predict(self, samples: list[LatencySample]) -> Predict | None:
        if self.predictor is None or not samples:
            return None
        first = min(s.arrived for s in samples)
        return self.predictor(np.array([s.arrived - first for s in samples]),
                              [(s.prompt_tokens, s.output_tokens) for s in samples])

    def _loads(self) -> dict[Role, dict[str, float]]:
        """Per role, its READY engines' queues and KV use (the health checks' reports)."""
        out: dict[Role, dict[str, float]] = {}
        for role in Role:
            loads = [s.load for s in self.fleet.slots.values() if s.role == role
                     and s.state is ReplicaState.READY and s.load is not None]
            if loads:
                out[role] = {"replicas": len(loads),
                             "running": sum(ld.num_running for ld in loads),
                             "waiting": sum(ld.num_waiting for ld in loads),
                             "kv_usage": sum(ld.kv_blocks_used / max(1, ld.kv_blocks_total)
                                             for ld in loads) / len(loads)}
        return out

    async def _apply(self, action: Action) -> None:
        fleet, role = self.fleet, action.role
        try:
            if action in (Action.ADD_PREFILL, Action.ADD_DECODE):
                done = f"started {'-'.join(map(str, fleet.add(role)))}"
            elif action in (Action.REMOVE_PREFILL, Action.REMOVE_DECODE):
                victim = self._least_busy(role)
                await fleet.drain(role, victim, self.drain_timeout_s)
                done = f"drained and stopped {role}-{victim}"
            else:       # a flip to `role` takes an engine of the other role
                other = role.other
                victim = self._least_busy(other)
                new = await fleet.flip(other, victim, self.drain_timeout_s)
                done = (f"{other}-{victim} is now {new[0]}-{new[1]}" if new
                        else f"{other}-{victim} stayed busy: role change given up")
        except Exception as e:  # noqa: BLE001 - logged; the next interval decides again
            logger.exception("planner: %s failed", action)
            done = f"failed: {e!r}"
        logger.info("planner: %s: %s", action, done)
        self._applied(action, done)

    def _applied(self, action: Action, done: str) -> None:
        for i in range(len(self.log) - 1, -1, -1):
            if self.log[i].action == action.value and not self.log[i].applied:
                r = self.log[i]
                self.log[i] = PlanRecord(r.at, r.action, r.reason, r.stats, r.loads, done)
                return

    def _least_busy(self, role: Role) -> int:
        ready = [s for s in self.fleet.slots.values()
                 if s.role == role and s.state is ReplicaState.READY]
        if not ready:
            raise RuntimeError(f"no READY {role} replica to take")
        busy = lambda s: (s.load.num_running + s.load.num_waiting if s.load else 0,  # noqa: E731
                          -s.replica_id)
        return min(ready, key=busy).replica_id


def profile_predictor(path: str, settings: PlannerSettings, percentile: float, engine: Any
                      ) -> Any:
    """`predictor` from a `pd-cluster profile` file: an interval's requests simulated on
    other tiers (pd_cluster/tuning/replay.py interval_predictor)."""
    from pd_cluster.tuning.profile import Profile
    from pd_cluster.tuning.replay import interval_predictor
    from pd_cluster.tuning.simulator import EngineLimits
    from pd_cluster.tuning.slo import SLO

    profile = Profile.load(path)
    limits = EngineLimits(int(profile.engine["kv_capacity_tokens"]), math.inf,
                          engine.max_num_batched_tokens, engine.max_num_seqs)
    slo = SLO(settings.ttft_s, settings.tpot_s, percentile)
    return lambda arrivals, lengths: interval_predictor(
        profile, limits, slo, settings.gpus_per_instance, arrivals, lengths)
