"""Disaggregation between tensor-parallel engines of different degrees, with real Ray actors
on the CPU (gloo ranks): P tp=2 -> D tp=1, P tp=1 -> D tp=2 and P tp=2 -> D tp=2 give the
greedy output of a colocated TP=1 engine (and HF), in push mode over nixl and ray and in pooled
mode; every KV block is free afterwards; a mapping that cannot work is refused at startup. A
mixture of experts too, expert parallel on its tp=2 side (P 1 -> D 2): the KV handoff
depends on the attention layout alone."""
from __future__ import annotations

import asyncio

import pytest

from tests.support.hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model

ray = pytest.importorskip("ray")
from tests.support.engine_clients import collect  # noqa: E402
from router.app import start_client  # noqa: E402
from router.app_config import AppConfig  # noqa: E402
from router.routing import Route  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

# Each case starts 3-5 engine processes on the CPU: out of the quick run (-m "not slow").
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2]]
OPTIONS = {"prefill": {"num_cpus": 0}, "decode": {"num_cpus": 0}}


def serve(model_dir: str, mode: str, transport: str, p_tp: int, d_tp: int, **engine):
    """`engine`: EngineConfig fields besides the model and a small KV cache."""
    config = AppConfig.from_args({
        "mode": mode, "transport": transport, "prefill_tensor_parallel_size": p_tp,
        "decode_tensor_parallel_size": d_tp,
        "engine": {"model": model_dir, "block_size": 16, "num_kv_blocks": 64, **engine}})
    client = start_client(config, config.engine, OPTIONS)
    asyncio.run(client.wait_ready(240))
    return client


def generate(client) -> list[list[int]]:
    async def go():
        return await asyncio.gather(*[collect(client, f"tp{i}", p, GREEDY, Route(0, 0))
                                      for i, p in enumerate(PROMPTS)])
    return [o.outputs[0].token_ids for o in asyncio.run(go())]


def _ranks(actor) -> int:
    """Runs in an engine actor: its KV cache's shards, one per tensor-parallel rank."""
    return len(actor.loop.engine.kv_shards())


def all_free(client) -> bool:
    loads = asyncio.run(client.loads())
    return bool(loads) and all(ld.kv_blocks_used == 0 and ld.num_running == 0 for ld in loads)


def colocated_greedy(family: str, root: str) -> tuple[str, list[list[int]]]:
    """The tiny model of `family` and a colocated TP=1 engine's greedy output (HF's)."""
    model_dir = make_tiny_model(family, root)
    colocated = [o.outputs[0].token_ids for o in LLM(model_dir).generate(PROMPTS, GREEDY)]
    assert colocated == hf_greedy(model_dir, PROMPTS, GREEDY.max_tokens)
    return model_dir, colocated


@pytest.fixture(scope="module")
def expected(tiny_model_root) -> tuple[str, list[list[int]]]:
    return colocated_greedy("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def moe_expected(tiny_model_root) -> tuple[str, list[list[int]]]:
    return colocated_greedy("qwen3_moe", tiny_model_root)


def check_serves_colocated_output(expected: tuple[str, list[list[int]]], mode: str,
                                  transport: str, p_tp: int, d_tp: int, **engine) -> None:
    """P at p_tp ranks and D at d_tp give the colocated output, and free every block."""
    model_dir, colocated = expected
    client = serve(model_dir, mode, transport, p_tp, d_tp, **engine)
    try:
        ranks = ray.get([a.__ray_call__.remote(_ranks) for a in client.prefill + client.decode],
                        timeout=60)
        assert ranks == [p_tp, d_tp]
        assert generate(client) == colocated
        wait_until(lambda: all_free(client), 20, 0.2, "every KV block free on P and D")
    finally:
        for actor in client.prefill + client.decode:
            ray.kill(actor)


# A covering set, not the cross product: each degree pair (2 -> 1, 1 -> 2, 2 -> 2), each
# transport and each mode appears at least once. Push mode over nixl from 1 to 2 ranks is
# also what test_a_killed_rank_of_a_tp2_decoder_migrates_its_stream_to_another serves its
# exact stream over. Each case starts 3-5 engine processes (about 10 s on 2 cores).
@pytest.mark.parametrize("mode, transport, p_tp, d_tp", [
    ("disaggregated", "nixl", 2, 2), ("disaggregated", "ray", 2, 1), ("pooled", "nixl", 1, 2)])
def test_tensor_parallel_degrees_may_differ_between_p_and_d(expected, mode, transport, p_tp,
                                                           d_tp):
    check_serves_colocated_output(expected, mode, transport, p_tp, d_tp)


# One side split, the other not: the experts split differently on P and D. The other
# direction and transport (P 2 -> D 1 over nixl) carries the same attention KV as the dense
# model's cases above: the handoff depends on the attention layout alone.
@pytest.mark.parametrize("transport, p_tp, d_tp", [("ray", 1, 2)])
def test_a_mixture_of_experts_may_split_its_experts_differently_on_p_and_d(
        moe_expected, transport, p_tp, d_tp):
    check_serves_colocated_output(moe_expected, "disaggregated", transport, p_tp, d_tp,
                                  enable_expert_parallel=True)


def test_a_mapping_that_cannot_work_is_refused_at_startup(tiny_model_root):
    """4 query heads cannot be split over 3 ranks: the replica fails to start, naming why."""
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    config = AppConfig.from_args({
        "mode": "disaggregated", "transport": "ray", "decode_tensor_parallel_size": 3,
        "engine": {"model": model_dir, "block_size": 16, "num_kv_blocks": 64}})
    client = start_client(config, config.engine, OPTIONS)
    try:
        with pytest.raises(RuntimeError, match="num_attention_heads \\(4\\) is not divisible"):
            asyncio.run(client.wait_ready(120))
    finally:
        client.fleet.shutdown()


def _first_worker_pid(actor) -> int:
    return actor.loop.engine.runner.workers.procs[0].pid


def test_a_killed_rank_of_a_tp2_decoder_migrates_its_stream_to_another(expected):
    """SIGKILL of rank 1 of the decode replica mid-stream: its engine's next step fails, the
    replica's process ends (RayActorError to the router), and the stream goes on on the other
    decoder with the exact tokens; no hang, every block free after."""
    import os
    import signal

    model_dir, _ = expected
    prompt = list(range(10, 50))
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    want = LLM(model_dir).generate([prompt], params)[0].outputs[0].token_ids
    config = AppConfig.from_args({
        "mode": "disaggregated", "transport": "nixl", "num_decode": 2,
        "decode_tensor_parallel_size": 2,
        "engine": {"model": model_dir, "block_size": 16, "num_kv_blocks": 64}})
    client = start_client(config, config.engine, OPTIONS)
    asyncio.run(client.wait_ready(240))
    victim = ray.get(client.decode[0].__ray_call__.remote(_first_worker_pid), timeout=60)
    try:
        async def kill_after_some(out):
            if len(out.outputs[0].token_ids) == 20:
                os.kill(victim, signal.SIGKILL)
        final = asyncio.run(asyncio.wait_for(
            collect(client, "rank-kill", prompt, params, Route(0, 0), kill_after_some), 180))
        assert final.outputs[0].token_ids == want
        assert final.outputs[0].finish_reason == "length"
        assert ("decode", 0) in client.dead
        wait_until(lambda: all_free(client), 20, 0.2, "every KV block free on P and D")
    finally:
        client.fleet.shutdown()
