"""Prefix reuse from the KV pool (pooled mode, real Ray actors): a prefill engine reads the
prompt's prefix blocks the pool holds instead of computing them, and the output stays
exactly a cold run's."""
from __future__ import annotations

import asyncio
import random

import pytest

from tests.support.engine_clients import collect, prefilled_tokens
from pd_cluster import LLM, SamplingParams
from router.routing import Route
from tests.support.tiny_models import make_tiny_model

ray = pytest.importorskip("ray")
from tests.support.pooled import shutdown, start  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
BS = 16   # the engines' block size (EngineConfig's default)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module", params=[True, False], ids=["shared_memory", "transport"])
def pooled(request, ray_cluster, tiny):
    """Two prefill engines (one puts a prefix into the pool, the other reads it), two decoders;
    blocks moved through the pool's shared memory (engines on its node), or the transport."""
    client = start(tiny, "nixl", num_decode=2, num_prefill=2, shared_memory=request.param)
    yield client
    shutdown(client)


def load_of(actor):
    return ray.get(actor.load.remote())


def test_prefill_reads_the_pools_prefix_instead_of_computing_it(pooled, tiny):
    rng = random.Random(27)
    shared = rng.sample(range(3, 500), 6 * BS)                 # 6 full blocks
    first = shared + rng.sample(range(3, 500), 10)             # puts them into the pool
    second = shared + rng.sample(range(3, 500), 2 * BS + 5)    # 8 full blocks + a tail
    cold = [o.outputs[0].token_ids for o in LLM(tiny).generate([first, second], GREEDY)]

    out = asyncio.run(collect(pooled, "r0", first, GREEDY, Route(0, 0)))
    assert out.outputs[0].token_ids == cold[0]
    hits_before = ray.get(pooled.handoff.pool.stats.remote())["hits"]
    p1_before = load_of(pooled.prefill[1])

    # Prefill engine 1 has none of it cached: 6 of the 8 full blocks (3/4) come from the pool.
    out = asyncio.run(collect(pooled, "r1", second, GREEDY, Route(0, 1)))
    assert out.outputs[0].token_ids == cold[1]
    p1_after = load_of(pooled.prefill[1])
    computed = prefilled_tokens(p1_after) - prefilled_tokens(p1_before)
    assert computed == len(second) - 6 * BS == 37
    assert out.num_cached_tokens >= 6 * BS            # the API's cached_tokens
    assert p1_after.prefix_hits - p1_before.prefix_hits == 6 * BS   # pd_prefix_cache_hits
    stats = ray.get(pooled.handoff.pool.stats.remote())
    assert stats["hits"] - hits_before >= 6 and stats["bytes_out"] > 0
    # Every engine is on the pool's node: with its shared memory, no block took the transport.
    shared = pooled.handoff.settings.shared_memory
    assert stats["bytes_copied"] == (stats["bytes_in"] + stats["bytes_out"] if shared else 0)


def test_a_decoder_prefilling_itself_reads_the_pools_prefix(pooled, tiny):
    rng = random.Random(28)
    prompt = rng.sample(range(3, 500), 5 * BS + 3)
    cold = LLM(tiny).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert asyncio.run(collect(pooled, "d0", prompt, GREEDY, Route(0, 0))).outputs[0].token_ids \
        == cold
    # Decoder 1 has none of it and prefills it itself (no prefill engine on the route): the
    # 5 full blocks come from the pool.
    before = prefilled_tokens(load_of(pooled.decode[1]))
    out = asyncio.run(collect(pooled, "d1", prompt, GREEDY, Route(1, None)))
    assert out.outputs[0].token_ids == cold
    assert prefilled_tokens(load_of(pooled.decode[1])) - before == 3
    assert out.num_cached_tokens == 5 * BS


def test_a_cache_salt_keeps_tenants_apart_in_prefix_caches_and_the_pool(pooled, tiny):
    """Tenant a's prompt is in P0's cache and the pool; tenant b's same prompt on P1 hits
    neither (cached_tokens 0), tenant a's on P1 reads a's blocks from the pool."""
    prompt = random.Random(31).sample(range(3, 500), 4 * BS + 3)

    def as_tenant(salt: str) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt)
    runs = [asyncio.run(collect(pooled, f"salt{i}", prompt, as_tenant(salt), Route(0, p)))
            for i, (salt, p) in enumerate([("a", 0), ("b", 1), ("a", 1)])]
    assert [r.num_cached_tokens for r in runs[:2]] == [0, 0]
    assert runs[2].num_cached_tokens == 4 * BS
    assert len({tuple(r.outputs[0].token_ids) for r in runs}) == 1
