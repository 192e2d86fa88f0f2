"""The P:D planner's policy (pd_cluster/planner.py): which tier it grows when TTFT or TPOT
misses its SLO, a flip when the GPU budget is spent, a removal when both tiers have slack,
one change per cooldown, and settings it refuses."""
from __future__ import annotations

import math
import re

import pytest

from pd_cluster.planner import Action, IntervalStats, Planner, PlannerSettings

SLO = dict(ttft_s=1.0, tpot_s=0.05)


def decide(num_p: int, num_d: int, ttft: float, tpot: float, budget: int = 8, **kw) -> Action:
    planner = Planner(PlannerSettings(**SLO, gpu_budget=budget, **kw))
    return planner.decide(IntervalStats(num_p, num_d, ttft, tpot, 100), now=0.0).action


def test_slow_first_tokens_grow_prefill_and_slow_decoding_grows_decode():
    assert decide(1, 1, ttft=2.0, tpot=0.04) is Action.ADD_PREFILL
    assert decide(1, 1, ttft=0.5, tpot=0.09) is Action.ADD_DECODE
    # Both over: the tier further over its SLO.
    assert decide(1, 1, ttft=3.0, tpot=0.06) is Action.ADD_PREFILL
    assert decide(1, 1, ttft=1.1, tpot=0.2) is Action.ADD_DECODE


def test_a_spent_budget_flips_an_engine_from_the_tier_with_headroom():
    assert decide(2, 2, ttft=2.0, tpot=0.01, budget=4) is Action.FLIP_TO_PREFILL
    assert decide(2, 2, ttft=0.2, tpot=0.09, budget=4) is Action.FLIP_TO_DECODE
    # No headroom on the other side, or it is at its minimum: nothing to do.
    assert decide(2, 2, ttft=2.0, tpot=0.04, budget=4) is Action.HOLD
    assert decide(3, 1, ttft=2.0, tpot=0.01, budget=4) is Action.HOLD


def test_quiet_engines_of_the_other_tier_give_one_up_when_both_slos_are_missed():
    """Live tiers: both objectives missed, no GPU to add. The tier further over gets an
    engine from the other only if that tier's engines queue nothing and use under
    `headroom` of their KV (its miss has another cause); unknown loads (the replay) hold."""
    planner = lambda: Planner(PlannerSettings(**SLO, gpu_budget=4))  # noqa: E731
    idle_decode = dict(decode_waiting=0, decode_kv_usage=0.3, prefill_waiting=3,
                       prefill_kv_usage=0.8)
    stats = IntervalStats(1, 3, 9.0, 0.07, 40, **idle_decode)
    decision = planner().decide(stats, now=0.0)
    assert decision.action is Action.FLIP_TO_PREFILL
    assert "engines queue nothing" in decision.reason
    busy_decode = {**idle_decode, "decode_waiting": 2}
    assert planner().decide(IntervalStats(1, 3, 9.0, 0.07, 40, **busy_decode),
                            now=0.0).action is Action.HOLD
    assert planner().decide(IntervalStats(1, 3, 9.0, 0.07, 40), now=0.0).action is Action.HOLD


def test_tensor_parallel_instances_count_their_gpus_against_the_budget():
    assert decide(1, 1, ttft=2.0, tpot=0.04, budget=4, gpus_per_instance=2) is Action.HOLD
    assert decide(1, 1, ttft=2.0, tpot=0.04, budget=6, gpus_per_instance=2) is \
        Action.ADD_PREFILL


def test_a_tier_with_slack_gives_one_back_down_to_its_minimum():
    calm = dict(calm_intervals=1)
    assert decide(2, 3, ttft=0.1, tpot=0.02, **calm) is Action.REMOVE_PREFILL   # more slack
    assert decide(2, 3, ttft=0.4, tpot=0.005, **calm) is Action.REMOVE_DECODE
    assert decide(1, 3, ttft=0.1, tpot=0.02, **calm) is Action.REMOVE_DECODE  # prefill at min
    assert decide(1, 1, ttft=0.1, tpot=0.02, **calm) is Action.HOLD
    # One tier well within, the other only within: the one with room gives an engine back.
    assert decide(2, 2, ttft=0.8, tpot=0.02, **calm) is Action.REMOVE_DECODE
    assert decide(2, 2, ttft=0.2, tpot=0.04, **calm) is Action.REMOVE_PREFILL
    assert decide(2, 2, ttft=0.8, tpot=0.04, **calm) is Action.HOLD   # within, no room


def test_a_removal_waits_for_calm_intervals_in_a_row():
    planner = Planner(PlannerSettings(**SLO, gpu_budget=8, calm_intervals=3, cooldown_s=0))
    quiet, busy = IntervalStats(2, 2, 0.1, 0.01, 50), IntervalStats(2, 2, 0.8, 0.04, 50)
    assert [planner.decide(quiet, now=t).action for t in (1, 2)] == [Action.HOLD] * 2
    assert planner.decide(busy, now=3).action is Action.HOLD      # not calm: starts over
    assert [planner.decide(quiet, now=t).action for t in (4, 5, 6)] == \
        [Action.HOLD, Action.HOLD, Action.REMOVE_PREFILL]


def test_one_change_per_cooldown_and_none_without_traffic():
    planner = Planner(PlannerSettings(**SLO, gpu_budget=8, cooldown_s=60))
    slow = IntervalStats(1, 1, 2.0, 0.04, 100)
    assert planner.decide(slow, now=0).action is Action.ADD_PREFILL
    held = planner.decide(IntervalStats(2, 1, 2.0, 0.04, 100), now=30)
    assert held.action is Action.HOLD and "cooling down" in held.reason
    assert planner.decide(IntervalStats(2, 1, 2.0, 0.04, 100), now=61).action is \
        Action.ADD_PREFILL
    idle = planner.decide(IntervalStats(3, 1, math.nan, math.nan, 0), now=200)
    assert idle.action is Action.HOLD and "no finished requests" in idle.reason


def test_every_decision_says_why_with_its_figures():
    d = Planner(PlannerSettings(**SLO, gpu_budget=8)).decide(
        IntervalStats(1, 2, 1.5, 0.03, 40), now=0)
    assert d.action is Action.ADD_PREFILL
    assert "TTFT over its SLO" in d.reason and "1500 ms (1.50x SLO)" in d.reason
    assert "1P2D" in d.reason


@pytest.mark.parametrize("kw, message", [
    (dict(gpu_budget=1), "gpu_budget: 1 is below the tiers' minimum (2 GPUs)"),
    (dict(gpu_budget=8, headroom=1.5), "headroom"),
    (dict(gpu_budget=8, min_prefill=3, max_prefill=2), "bounds"),
    (dict(gpu_budget=8, ttft_s=0), "SLOs"),
])
def test_impossible_settings_are_refused_naming_them(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PlannerSettings(**{**SLO, **kw})


def test_a_prediction_that_the_smaller_tiers_would_miss_vetoes_the_removal():
    asked = []

    def predict(num_p: int, num_d: int) -> tuple[float, float]:
        asked.append((num_p, num_d))
        return (2.0, 0.01) if num_p < 2 else (0.3, 0.01)    # one P fewer: TTFT misses
    planner = Planner(PlannerSettings(**SLO, gpu_budget=8, calm_intervals=1), predict)
    quiet = IntervalStats(2, 3, 0.1, 0.02, 50)
    d = planner.decide(quiet, now=0)
    assert d.action is Action.REMOVE_DECODE and asked == [(1, 3), (2, 2)]
    assert "would miss" not in d.reason
    veto = Planner(PlannerSettings(**SLO, gpu_budget=8, calm_intervals=1),
                   lambda p, d: (2.0, 0.01)).decide(quiet, now=0)
    assert veto.action is Action.HOLD and "1P3D would miss (predicted TTFT 2000 ms" in veto.reason
