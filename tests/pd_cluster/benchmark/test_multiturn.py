"""`pd-cluster bench --multi-turn`'s conversations, in process (no server; the end-to-end run
against a served model is tests/bench/test_kv_tiers_serving.py): each turn re-sends the
context so far, so turn k's prompt extends turn k-1's prompt and answer; the per-turn report
counts what the records say; options that cannot run are refused naming the flag."""
from __future__ import annotations

import numpy as np
import pytest

from pd_cluster.benchmark.client import Endpoint, RequestRecord
from pd_cluster.benchmark.multiturn import (
    MultiTurnSettings,
    TurnRecord,
    build_conversations,
    report,
)
from pd_cluster.cli import main
from pd_cluster.tuning.slo import SLO


def test_each_turn_resends_the_context_so_far_with_one_new_message():
    settings = MultiTurnSettings(conversations=3, turns=4, system_tokens=40, user_tokens=7,
                                 output_tokens=5, concurrency=2)
    conversations = build_conversations(settings, np.random.default_rng(1))
    assert len({c.system for c in conversations}) == 1          # one shared system prompt
    assert len({c.users[0] for c in conversations}) == 3        # each its own messages
    conv = conversations[0]
    for turn in range(settings.turns):
        prompt = conv.prompt(turn)
        assert conv.words(turn) == settings.context_tokens(turn)
        assert prompt.startswith(conv.system) and prompt.endswith(conv.users[turn])
        if turn:
            assert prompt.startswith(conv.prompt(turn - 1) + " " + conv.answers[turn - 1] + " ")
        conv.answers.append(" ".join(f"a{turn}x{i}" for i in range(settings.output_tokens)))
    messages = conv.messages(3)
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in messages[2::2]] == conv.answers[:3]
    assert Endpoint("http://x/v1", "m", chat=True).body(messages, 5)["messages"] == messages


def test_the_report_counts_cached_tokens_and_goodput_per_turn():
    settings = MultiTurnSettings(conversations=2, turns=2, concurrency=1)

    def rec(n: int, ttft: float, prompt: int, cached: int | None) -> RequestRecord:
        return RequestRecord(n, prompt, 4, ok=True, prompt_tokens=prompt, output_tokens=4,
                             ttft=ttft, tpot=0.01, e2e=ttft + 0.03, cached_tokens=cached)
    turns = [TurnRecord(0, 0, rec(0, 0.2, 100, 96)), TurnRecord(1, 0, rec(1, 0.4, 100, 96)),
             TurnRecord(0, 1, rec(2, 0.1, 200, 192)), TurnRecord(1, 1, rec(3, 2.0, 200, 0))]
    out = report(turns, 4.0, SLO(1.0, 0.05), settings)
    assert (out["conversations_completed"], out["cached_prompt_tokens"]) == (2, 384)
    assert out["goodput"] == pytest.approx(3 / 4.0)
    first, second = out["per_turn"]
    assert first["cached_tokens_mean"] == 96 and first["slo_attainment"] == 1.0
    assert second["cached_fraction"] == pytest.approx(192 / 400)
    assert second["ttft"]["p50"] == pytest.approx(1.05)


@pytest.mark.parametrize("argv, message", [
    (["-n", "5"], "-n does not apply to --multi-turn"),
    (["--output-len", "uniform:1:9"], "--output-len: --multi-turn takes one length"),
    (["--turns", "0"], "--turns: must be >= 1"),
    (["--think-time=-1s"], "--think-time"),
    (["--concurrency", "0"], "--concurrency: must be >= 1"),
])
def test_options_that_cannot_run_are_refused_naming_the_flag(argv, message, capsys):
    assert main(["bench", "--multi-turn", "--model", "m", *argv]) == 2
    assert message in capsys.readouterr().err


def test_multi_turn_options_alone_are_refused(capsys):
    assert main(["bench", "--model", "m", "--turns", "3"]) == 2
    assert "--turns needs --multi-turn" in capsys.readouterr().err
