"""Disaggregated prefill/decode with an fp8 KV cache, over real Ray engine actors: P's fp8
blocks (one byte an element, with the per-layer scales both engines calibrated alike) reach
D over NIXL and over the Ray object store, and D's tokens equal a colocated fp8 engine's;
a P whose KV cache is 16/32-bit and a D with fp8 refuse each other at startup, the error
naming both dtypes."""
from __future__ import annotations

import asyncio

import pytest

from tests.support.engine_clients import collect
from pd_cluster import LLM, EngineConfig, SamplingParams
from router.routing import Route
from tests.support.tiny_models import make_tiny_model

ray = pytest.importorskip("ray")
from actors.engine_actor import EngineActor  # noqa: E402
from router.disagg_client import DisaggregatedClient  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2]]


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


def actors(model_dir, transport, prefill_kv="fp8", decode_kv="fp8"):
    def cfg(kv):
        return EngineConfig(model=model_dir, block_size=16, num_kv_blocks=64, kv_cache_dtype=kv)
    return ([EngineActor.options(num_cpus=0).remote(cfg(prefill_kv), "prefill", 0, transport,
                                                    30.0)],
            [EngineActor.options(num_cpus=0).remote(cfg(decode_kv), "decode", 0, transport,
                                                    30.0)])


def run_all(client, prompts):
    async def go():
        return await asyncio.gather(*[collect(client, f"q{i}", p, GREEDY, Route(0, 0))
                                      for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in asyncio.run(go())]


@pytest.fixture(scope="module")
def colocated_fp8(tiny):
    llm = LLM(tiny, block_size=16, num_kv_blocks=64, kv_cache_dtype="fp8")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("transport", ["nixl", "ray"])
def test_fp8_disaggregated_equals_colocated_fp8(transport, tiny, colocated_fp8):
    p, d = actors(tiny, transport)
    try:
        client = DisaggregatedClient.over(p, d)
        asyncio.run(client.wait_ready(120))
        assert run_all(client, PROMPTS) == colocated_fp8
        load = ray.get(p[0].load.remote())
        # Every prompt's blocks went over: ceil(len / 16) blocks x 2 layers x K, V x 16
        # tokens x 2 KV heads x 16 dims, one byte each (bf16 would be twice that).
        blocks = sum(-(-len(prompt) // 16) for prompt in PROMPTS)
        assert load.kv_bytes_transferred == blocks * 2 * 2 * 16 * 2 * 16
    finally:
        for a in p + d:
            ray.kill(a)


def test_a_16_bit_prefill_and_an_fp8_decode_refuse_each_other_at_startup(tiny):
    p, d = actors(tiny, "nixl", prefill_kv="auto", decode_kv="fp8")
    try:
        client = DisaggregatedClient.over(p, d)
        with pytest.raises(RuntimeError) as failed:
            asyncio.run(client.wait_ready(120))
        message = str(failed.value)
        print(message)
        assert "failed to join the KV handoff" in message and "KV cache dtype" in message
        assert ("'float32' != 'float8_e4m3fn'" in message
                or "'float8_e4m3fn' != 'float32'" in message)
    finally:
        for a in p + d:
            ray.kill(a)
