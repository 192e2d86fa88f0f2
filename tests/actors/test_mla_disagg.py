"""Disaggregated prefill/decode of a DeepSeek model (multi-head latent attention) with real Ray
actors: its latent KV cache moves from P to D over NIXL and Ray as any cache does, and D's
greedy output equals a colocated engine's, with every KV block free afterwards."""
from __future__ import annotations

import pytest

from pd_cluster import LLM
from tests.support.tiny_deepseek import make_tiny_deepseek

ray = pytest.importorskip("ray")
from tests.support.disagg import (GREEDY, load_of, run_all, shutdown, start,  # noqa: E402
                                  wait_all_free)
from tests.support.engine_clients import prefilled_tokens  # noqa: E402

# Two engine actors a case, on 2 cores: out of the quick run.
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]
PROMPTS = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2]]


@pytest.fixture(scope="module")
def colocated(tiny_model_root) -> tuple[str, list[list[int]]]:
    model_dir = make_tiny_deepseek("deepseek_v3", tiny_model_root)
    llm = LLM(model_dir, block_size=16)
    assert llm.engine.kv_layout.latent
    return model_dir, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("transport", ["nixl", "ray"])
def test_disaggregated_latent_cache_equals_colocated(transport, colocated):
    model_dir, expected = colocated
    if transport == "nixl":
        pytest.importorskip("nixl")
    client = start(model_dir, transport)
    try:
        assert run_all(client, PROMPTS) == expected
        # P computed the prompts (less the prefix two of them share, cached), D none: every
        # prompt token's latent came over.
        assert prefilled_tokens(load_of(client.prefill[0])) == sum(map(len, PROMPTS)) - 32
        assert prefilled_tokens(load_of(client.decode[0])) == 0
        wait_all_free(client, 20)
    finally:
        shutdown(client)
