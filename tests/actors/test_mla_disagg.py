"""Disaggregated prefill/decode of a DeepSeek model (multi-head latent attention) with real Ray
actors: its latent KV cache moves from P to D over NIXL and Ray as any cache does, and D's
greedy output equals a colocated engine's, with every KV block free afterwards; also between
engines of different tensor-parallel degrees, where every rank holds the whole latent and
each D rank takes P's first copy."""
from __future__ import annotations

import asyncio

import pytest

from pd_cluster import LLM
from tests.support.tiny_deepseek import make_tiny_deepseek

ray = pytest.importorskip("ray")
from router.app import start_client  # noqa: E402
from router.app_config import AppConfig  # noqa: E402
from router.routing import Route  # noqa: E402
from tests.support.disagg import (GREEDY, load_of, run_all, shutdown, start,  # noqa: E402
                                  wait_all_free)
from tests.support.engine_clients import collect, prefilled_tokens  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

# Two engine actors a case, on 2 cores: out of the quick run.
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]
PROMPTS = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2]]


@pytest.fixture(scope="module")
def colocated(tiny_model_root) -> tuple[str, list[list[int]]]:
    model_dir = make_tiny_deepseek("deepseek_v3", tiny_model_root)
    llm = LLM(model_dir, block_size=16)
    assert llm.engine.kv_layout.latent
    return model_dir, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


# Over nixl between single-rank engines; the latent cache moves over ray too in
# test_latent_cache_moves_between_tensor_parallel_degrees (P 1 rank -> D 2), whose output
# equals the same colocated engine's.
@pytest.mark.parametrize("transport", ["nixl"])
def test_disaggregated_latent_cache_equals_colocated(transport, colocated):
    model_dir, expected = colocated
    if transport == "nixl":
        pytest.importorskip("nixl")
    client = start(model_dir, transport)
    try:
        assert run_all(client, PROMPTS) == expected
        # P computed the prompts (less a shared prefix, when it found it cached), D none:
        # every prompt token's latent came over.
        assert prefilled_tokens(load_of(client.prefill[0])) >= sum(map(len, PROMPTS)) - 32
        assert prefilled_tokens(load_of(client.decode[0])) == 0
        wait_all_free(client, 20)
    finally:
        shutdown(client)


def _kv_shards(actor) -> int:
    """Runs in an engine actor: its KV cache's shards (one per tensor-parallel rank), each
    latent."""
    shards = actor.loop.engine.kv_shards()
    assert all(layout.latent and layout.num_kv_heads == 1 for _, layout in shards)
    return len(shards)


@pytest.mark.parametrize("transport, p_tp, d_tp", [("nixl", 2, 1), ("ray", 1, 2)])
def test_latent_cache_moves_between_tensor_parallel_degrees(colocated, transport, p_tp, d_tp):
    model_dir, expected = colocated
    config = AppConfig.from_args({
        "mode": "disaggregated", "transport": transport, "prefill_tensor_parallel_size": p_tp,
        "decode_tensor_parallel_size": d_tp,
        "engine": {"model": model_dir, "block_size": 16, "num_kv_blocks": 64}})
    client = start_client(config, config.engine, {"prefill": {"num_cpus": 0},
                                                  "decode": {"num_cpus": 0}})
    try:
        asyncio.run(client.wait_ready(240))
        actors = client.prefill + client.decode
        assert ray.get([a.__ray_call__.remote(_kv_shards) for a in actors],
                       timeout=60) == [p_tp, d_tp]

        async def generate():
            return await asyncio.gather(*[collect(client, f"tp{i}", p, GREEDY, Route(0, 0))
                                          for i, p in enumerate(PROMPTS)])
        assert [o.outputs[0].token_ids for o in asyncio.run(generate())] == expected
        wait_until(lambda: all(ld.kv_blocks_used == 0 and ld.num_running == 0
                               for ld in asyncio.run(client.loads())), 20, 0.2,
                   "every KV block free on P and D")
    finally:
        for actor in client.prefill + client.decode:
            ray.kill(actor)
