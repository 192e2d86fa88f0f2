"""Disaggregated prefill/decode with real Ray actors: output equal to colocated and HF for
each CPU transport, overlap of transfer and compute, and each failure ending as specified
with every KV block free afterwards."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from hf_reference import hf_greedy
from pd_cluster import LLM, EngineConfig, SamplingParams
from router.routing import Route
from tiny_models import make_tiny_model

ray = pytest.importorskip("ray")
from actors.decode_actor import DecodingActor  # noqa: E402
from router.disagg_client import DisaggregatedClient, EngineUnavailable  # noqa: E402
from actors.prefill_actor import PrefillActor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def start(model_dir, transport, num_p=1, num_d=1, recompute=True, lease_s=60.0, **engine):
    cfg = EngineConfig(model=model_dir, block_size=16, **engine)
    p = [PrefillActor.options(num_cpus=0).remote(cfg, i, transport, 30.0)
         for i in range(num_p)]
    d = [DecodingActor.options(num_cpus=0).remote(cfg, i, transport, 30.0, lease_s)
         for i in range(num_d)]
    client = DisaggregatedClient(p, d, recompute)
    asyncio.run(client.wait_ready(120))
    return client


async def collect(client, rid, prompt, params, route, on_output=None):
    final = None
    async for out in client.generate(rid, prompt, params, route):
        final = out
        if on_output is not None:
            await on_output(out)
    return final


def run_all(client, prompts, params=GREEDY, routes=None):
    async def go():
        return await asyncio.gather(*[
            collect(client, f"q{i}", p, params, (routes or {}).get(i, Route(0, 0)))
            for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in asyncio.run(go())]


def assert_all_free(client):
    loads = asyncio.run(client.loads())
    assert loads and all(ld.kv_blocks_used == 0 and ld.num_running == 0 for ld in loads), loads


def shutdown(client):
    for a in client.prefill + client.decode:
        ray.kill(a)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


def shared_prefix_prompts(n):
    base = list(range(3, 60))
    return [base[: 20 + (i % 5) * 8] + [100 + i, 200 + i] for i in range(n)]


@pytest.mark.parametrize("transport", ["nixl", "ucx", "ray"])
def test_disaggregated_equals_colocated_equals_hf(transport, tiny):
    prompts = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2]]
    hf = hf_greedy(tiny, prompts, GREEDY.max_tokens)
    colocated = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, GREEDY)]
    client = start(tiny, transport)
    try:
        disagg = run_all(client, prompts)
        # Conditional disaggregation: the route leaves prefill to D.
        on_d = run_all(client, prompts, routes={i: Route(0, None) for i in range(3)})
        assert disagg == colocated == hf == on_d
        assert_all_free(client)
    finally:
        shutdown(client)


def test_32_concurrent_requests_with_shared_prefixes_complete(tiny):
    prompts = shared_prefix_prompts(32)
    expected = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, GREEDY)]
    client = start(tiny, "nixl", num_d=2)
    try:
        routes = {i: Route(i % 2, 0) for i in range(32)}
        assert run_all(client, prompts, routes=routes) == expected
        loads = asyncio.run(client.loads())
        assert sum(ld.prefix_hits for ld in loads) > 0
        assert_all_free(client)
    finally:
        shutdown(client)


def test_default_model_disaggregated_equals_colocated_and_overlaps(default_model_dir):
    prompt = list(range(100, 700))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    colocated = LLM(default_model_dir).generate([prompt], params)[0].outputs[0].token_ids
    assert colocated == hf_greedy(default_model_dir, [prompt], 8)[0]
    client = start(default_model_dir, "nixl")
    try:
        assert run_all(client, [prompt], params) == [colocated]
        marks = ray.get(client.prefill[0].timeline.remote())
        computed = {layer: t for what, layer, t in marks if what == "computed"}
        posted = {layer: t for what, layer, t in marks if what == "posted"}
        # Transfer of layer i starts before layer i + 1's compute ends.
        assert all(posted[i] < computed[i + 1] for i in range(len(computed) - 1))
        assert_all_free(client)
    finally:
        shutdown(client)


def test_killed_decoder_mid_stream_continues_on_another(tiny):
    prompt = list(range(10, 50))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    expected = LLM(tiny).generate([prompt], params)[0].outputs[0].token_ids
    client = start(tiny, "nixl", num_d=2)
    try:
        async def kill_after_some(out):
            if len(out.outputs[0].token_ids) == 20:
                ray.kill(client.decode[0])
        final = asyncio.run(collect(client, "k", prompt, params, Route(0, 0), kill_after_some))
        assert final.outputs[0].token_ids == expected
        assert final.outputs[0].finish_reason == "length"
        assert_all_free(client)
    finally:
        shutdown(client)


def test_killed_decoder_with_no_spare_fails_clearly(tiny):
    client = start(tiny, "nixl", num_d=1)
    try:
        async def kill_now(out):
            ray.kill(client.decode[0])
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineUnavailable, match="no live decode replica"):
            asyncio.run(collect(client, "k", [5, 6, 7], params, Route(0, 0), kill_now))
        loads = asyncio.run(client.loads())
        assert all(ld.kv_blocks_used == 0 for ld in loads)  # the prefill side holds nothing
    finally:
        shutdown(client)


def test_killed_prefiller_mid_prefill_falls_back(default_model_dir):
    prompt = list(range(100, 1100))
    params = SamplingParams(temperature=0, max_tokens=4)
    expected = LLM(default_model_dir).generate([prompt], params)[0].outputs[0].token_ids
    client = start(default_model_dir, "nixl", num_p=2, max_num_batched_tokens=128)
    try:
        async def go():
            task = asyncio.create_task(collect(client, "p", prompt, params, Route(0, 0)))
            await asyncio.sleep(1.0)     # 1000 tokens in 128-token chunks: still prefilling
            ray.kill(client.prefill[0])
            return await task
        final = asyncio.run(go())
        assert final.outputs[0].token_ids == expected
        assert_all_free(client)
    finally:
        shutdown(client)


@pytest.mark.parametrize("recompute", [True, False])
def test_failed_transfer_follows_the_policy(tiny, recompute):
    prompt = list(range(10, 60))
    expected = LLM(tiny).generate([prompt], GREEDY)[0].outputs[0].token_ids
    client = start(tiny, "nixl", recompute=recompute)
    try:
        ray.get(client.prefill[0].fail_next_transfer.remote())
        if recompute:
            assert run_all(client, [prompt]) == [expected]
        else:
            with pytest.raises(EngineUnavailable, match="injected transfer failure"):
                run_all(client, [prompt])
        assert_all_free(client)
    finally:
        shutdown(client)


def test_abort_mid_stream_frees_blocks_on_both_sides(tiny):
    client = start(tiny, "nixl")
    try:
        async def go():
            params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            streams = [client.generate(f"a{i}", list(range(5, 40 + i)), params, Route(0, 0))
                       for i in range(4)]
            for s in streams:
                await s.__anext__()
            for s in streams:
                await s.aclose()
            await asyncio.sleep(1.0)
        asyncio.run(go())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            loads = asyncio.run(client.loads())
            if all(ld.kv_blocks_used == 0 and ld.num_running == 0 for ld in loads):
                break
            time.sleep(0.2)
        assert_all_free(client)
    finally:
        shutdown(client)


def test_unclaimed_reservation_expires(tiny):
    client = start(tiny, "nixl", lease_s=3.0)
    try:
        dest = ray.get(client.decode[0].reserve.remote("orphan", [5, 6, 7, 8], GREEDY))
        assert dest is not None and dest.block_ids
        used = asyncio.run(client.loads())[1].kv_blocks_used
        assert used > 0
        time.sleep(4)   # past the 3 s lease
        assert_all_free(client)
    finally:
        shutdown(client)
