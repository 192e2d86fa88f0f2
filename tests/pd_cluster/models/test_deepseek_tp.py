"""Tensor parallelism of DeepSeek models: two CPU ranks (gloo) compute the logits of one model
alone, query heads and experts split, the latent KV cache whole on each rank (as
tests/pd_cluster/models/test_tensor_parallel_model.py does for the Llama family)."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support.tiny_deepseek import make_tiny_deepseek
from tests.support.tp_ranks import TP, rank_cases, run_ranks, two_steps_logits

# (family, load_format): q-LoRA and noaux_tc routing; no q-LoRA; random weights per rank.
CASES = [("deepseek_v3", "auto"), ("deepseek_v2_lite", "auto"), ("deepseek_v2", "dummy")]
# Two spawned ranks building three models each on 2 cores.
pytestmark = pytest.mark.slow


def _rank_main(rank: int, init_method: str, cases: list[tuple[str, str, str]],
               out_dir: str) -> None:
    rank_cases(rank, init_method, cases, out_dir, two_steps_logits)


@pytest.fixture(scope="module")
def rank_outputs(tiny_model_root, tmp_path_factory) -> str:
    out_dir = str(tmp_path_factory.mktemp("deepseek_tp_ranks"))
    cases = [(f"{f}-{fmt}", make_tiny_deepseek(f, tiny_model_root), fmt) for f, fmt in CASES]
    run_ranks(_rank_main, cases, out_dir)
    return out_dir


@pytest.mark.parametrize("family,load_format", CASES)
def test_two_ranks_give_the_logits_of_one(family, load_format, rank_outputs, tiny_model_root):
    expected = two_steps_logits(make_tiny_deepseek(family, tiny_model_root), load_format)
    for rank in range(TP):
        stem = os.path.join(rank_outputs, f"{family}-{load_format}.rank{rank}")
        if os.path.exists(stem + ".err"):
            with open(stem + ".err") as f:
                pytest.fail(f"rank {rank} failed:\n" + f.read())
        if not os.path.exists(stem + ".pt"):
            pytest.fail(f"rank {rank} has no logits: an earlier case failed on some rank")
        torch.testing.assert_close(torch.load(stem + ".pt"), expected, rtol=1e-4, atol=1e-5)
