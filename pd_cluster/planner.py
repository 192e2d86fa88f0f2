"""The P:D planner's policy: from one interval's measurements, what to change in the tiers
(the prefill and the decode engine replicas).

Each interval the planner looks at the interval's TTFT and TPOT at the SLO percentile and the
tier sizes, and returns one Decision (an Action and why):

    TTFT over its SLO, TPOT within     → more prefill: ADD_PREFILL while the GPU budget and
                                          max_prefill allow, else FLIP_TO_PREFILL a decode
                                          engine when decode has headroom (TPOT well within,
                                          or, live, its engines queue nothing and use under
                                          `headroom` of their KV)
    TPOT over its SLO, TTFT within     → more decode: the mirror image
    both over                          → add to the tier further over its SLO, if room, else
                                          flip to it if the other's engines are quiet
    both met, one well within (under `headroom` × its SLO), for `calm_intervals` intervals
    in a row                           → REMOVE from the tier well within (the one with more
                                          slack if both are; down to its min), unless
                                          `predict` (from a profile) says the smaller tiers
                                          would miss an SLO on this interval's load
    otherwise, or within `cooldown_s` of the last change, or no requests → HOLD

One change per decision, then a cooldown: a new engine takes a while to load and the next
interval's figures must show its effect before the planner acts again. Removing waits for
several calm intervals: growing fixes a miss at once, shrinking on one quiet interval made
the tiers swing back and forth under a steady load (seen in the replay). A flip keeps the
engine's weights loaded, so it is preferred over remove-then-add when the budget is spent.
No Ray here: the engine controller applies decisions to live tiers, and `pd-cluster tune`
can replay it over simulated intervals.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from pd_cluster.role import Role

# (prefill count, decode count) -> predicted (TTFT, TPOT) at the SLO percentile, seconds, of
# the last interval's requests on those tiers (the tune replay simulates them from a profile).
Predict = Callable[[int, int], tuple[float, float]]


class Action(str, enum.Enum):
    HOLD = "hold"
    ADD_PREFILL = "add_prefill"
    ADD_DECODE = "add_decode"
    REMOVE_PREFILL = "remove_prefill"
    REMOVE_DECODE = "remove_decode"
    FLIP_TO_PREFILL = "flip_to_prefill"     # a decode engine becomes a prefill one
    FLIP_TO_DECODE = "flip_to_decode"       # a prefill engine becomes a decode one

    def __str__(self) -> str:
        return self.value

    @property
    def role(self) -> Role | None:
        """The role whose tier the action grows, shrinks or flips an engine to; None: HOLD."""
        return None if self is Action.HOLD else Role(self.value.rpartition("_")[2])


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """The planner's targets and bounds (GPUs count instances × gpus_per_instance)."""

    ttft_s: float
    tpot_s: float
    gpu_budget: int
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64
    cooldown_s: float = 60.0
    headroom: float = 0.5           # a tier under headroom × its SLO has room to give
    calm_intervals: int = 3         # intervals in a row with room to give before a removal
    gpus_per_instance: int = 1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError("planner SLOs: ttft and tpot must be > 0")
        if self.calm_intervals < 1:
            raise ValueError(f"planner calm_intervals: {self.calm_intervals} is below 1")
        if not 0 < self.headroom < 1:
            raise ValueError(f"planner headroom: {self.headroom} is not in (0, 1)")
        if not (1 <= self.min_prefill <= self.max_prefill
                and 1 <= self.min_decode <= self.max_decode):
            raise ValueError("planner bounds: need 1 <= min <= max for prefill and decode")
        least = (self.min_prefill + self.min_decode) * self.gpus_per_instance
        if self.gpu_budget < least:
            raise ValueError(f"planner gpu_budget: {self.gpu_budget} is below the tiers' "
                             f"minimum ({least} GPUs)")


@dataclass(frozen=True, slots=True)
class IntervalStats:
    """One interval as measured: tier sizes, and TTFT / TPOT (seconds) at the SLO percentile
    of the requests that finished in it (nan: none finished). Live tiers add what their
    engines report at the interval's end (the replay has none): requests waiting in each
    tier's queues and its mean KV use (nan: unknown)."""

    num_prefill: int
    num_decode: int
    ttft: float
    tpot: float
    requests: int
    prefill_waiting: float = math.nan
    decode_waiting: float = math.nan
    prefill_kv_usage: float = math.nan
    decode_kv_usage: float = math.nan

    def quiet(self, role: Role, headroom: float) -> bool:
        """Whether `role`'s engines have room by their own reports: nothing queued and under
        `headroom` of their KV in use (False when unknown)."""
        waiting, kv = getattr(self, f"{role}_waiting"), getattr(self, f"{role}_kv_usage")
        return waiting == 0 and kv < headroom


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    stats: IntervalStats


class Planner:
    """Decides one change per interval; `decide(stats, now)` with `now` in seconds (any
    monotonic clock; the replay's simulated one). `predict`, when given, vets removals."""

    def __init__(self, settings: PlannerSettings, predict: Predict | None = None) -> None:
        self.settings, self.predict = settings, predict
        self.changed_at = -math.inf
        self.calm = 0           # intervals in a row with both SLOs met, one well within

    def decide(self, stats: IntervalStats, now: float) -> Decision:
        decision = self._decide(stats, now)
        if decision.action is not Action.HOLD:
            self.changed_at, self.calm = now, 0
        return decision

    def _decide(self, s: IntervalStats, now: float) -> Decision:
        cfg = self.settings
        hold = lambda why: Decision(Action.HOLD, why, s)   # noqa: E731 - four uses below
        if now - self.changed_at < cfg.cooldown_s:
            return hold(f"cooling down ({now - self.changed_at:.0f} of {cfg.cooldown_s:g} s "
                        "since the last change)")
        if s.requests == 0 or math.isnan(s.ttft) or math.isnan(s.tpot):
            return hold("no finished requests this interval")
        ttft, tpot = s.ttft / cfg.ttft_s, s.tpot / cfg.tpot_s     # 1.0: exactly at the SLO
        # Calm: both objectives met and at least one tier well within (room to give back).
        self.calm = self.calm + 1 if max(ttft, tpot) <= 1 and min(ttft, tpot) < cfg.headroom \
            else 0
        figures = f"TTFT {s.ttft * 1e3:.0f} ms ({ttft:.2f}x SLO), TPOT {s.tpot * 1e3:.1f} ms " \
                  f"({tpot:.2f}x SLO), {s.num_prefill}P{s.num_decode}D"
        room = (s.num_prefill + s.num_decode + 1) * cfg.gpus_per_instance <= cfg.gpu_budget
        if ttft > 1 and tpot <= 1:
            return self._grow(Role.PREFILL, s, room, tpot < cfg.headroom, figures)
        if tpot > 1 and ttft <= 1:
            return self._grow(Role.DECODE, s, room, ttft < cfg.headroom, figures)
        if ttft > 1 and tpot > 1:
            # Both missed: the tier further over grows; an engine can come from the other
            # only if its engines say they have room (its latency may be missed for another
            # reason, e.g. the first decode step after a long prompt's handover).
            worse = Role.PREFILL if ttft >= tpot else Role.DECODE
            return self._grow(worse, s, room, False, figures)
        if self.calm >= cfg.calm_intervals:
            return self._shrink(s, ttft, tpot, figures)
        if self.calm:
            return hold(f"room to give back for {self.calm} of {cfg.calm_intervals} "
                        f"intervals before a removal: {figures}")
        return hold(f"within the SLOs: {figures}")

    def _grow(self, role: Role, s: IntervalStats, room: bool, other_has_headroom: bool,
              figures: str) -> Decision:
        cfg = self.settings
        other = role.other
        have, most = getattr(s, f"num_{role}"), getattr(cfg, f"max_{role}")
        others, least = getattr(s, f"num_{other}"), getattr(cfg, f"min_{other}")
        short = "TTFT" if role is Role.PREFILL else "TPOT"
        if room and have < most:
            return Decision(Action(f"add_{role}"), f"{short} over its SLO: {figures}", s)
        quiet = s.quiet(other, cfg.headroom)
        if (other_has_headroom or quiet) and others > least and have < most:
            why = "has headroom" if other_has_headroom else \
                "engines queue nothing and use little KV"
            return Decision(Action(f"flip_to_{role}"),
                            f"{short} over its SLO, no GPU to add, {other} {why}: "
                            f"{figures}", s)
        return Decision(Action.HOLD, f"{short} over its SLO but {role} cannot grow "
                        f"(budget {cfg.gpu_budget} GPUs, max_{role} {most}): {figures}", s)

    def _shrink(self, s: IntervalStats, ttft: float, tpot: float, figures: str) -> Decision:
        cfg = self.settings
        vetoed = []
        # The tier with more slack gives one back, if it may (and the prediction agrees).
        for role in ((Role.PREFILL, Role.DECODE) if ttft <= tpot else (Role.DECODE, Role.PREFILL)):
            ratio = ttft if role is Role.PREFILL else tpot
            if ratio >= cfg.headroom or getattr(s, f"num_{role}") <= getattr(cfg, f"min_{role}"):
                continue
            p, d = s.num_prefill - (role is Role.PREFILL), s.num_decode - (role is Role.DECODE)
            if self.predict is not None:
                t, o = self.predict(p, d)
                if t > cfg.ttft_s or o > cfg.tpot_s:
                    vetoed.append(f"{p}P{d}D would miss (predicted TTFT {t * 1e3:.0f} ms, "
                                  f"TPOT {o * 1e3:.1f} ms)")
                    continue
            short = "TTFT" if role is Role.PREFILL else "TPOT"
            return Decision(Action(f"remove_{role}"),
                            f"both SLOs met, {short} well within: {figures}", s)
        why = "; ".join(vetoed) if vetoed else "the tiers with room are at their minimum"
        return Decision(Action.HOLD, f"room to give back, but {why}: {figures}", s)
