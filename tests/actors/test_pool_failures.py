"""Pooled mode's failures with real Ray actors: the KV pool actor killed under load fails no
request, a prefill engine killed mid-put leaves no hold in the pool, and a failed read on
the decoder recomputes the prompt there with the output still exact."""
from __future__ import annotations

import asyncio

import pytest

from tests.support.engine_clients import collect, prefilled_tokens
from pd_cluster import LLM, EngineConfig, SamplingParams
from router.routing import Route
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until

ray = pytest.importorskip("ray")
from actors.engine_actor import EngineActor  # noqa: E402
from actors.kv_pool import start_pool  # noqa: E402
from actors.pool_handoff import PoolHandoff, PoolReceiver  # noqa: E402
from actors.pool_index import prompt_keys  # noqa: E402
from router.disagg_client import DisaggregatedClient  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [list(range(5 + i, 60 + 3 * i)) for i in range(6)]   # partial last blocks


class FailingRead(PoolReceiver):
    """D's part of a pool handoff whose reads find a block missing: the request's hold ends
    (its partial last block dropped from the pool) just before D reads, as when the hold
    expired."""

    async def receive(self, request_id, reservation, result):
        await self.pools.home.release(request_id)
        return await super().receive(request_id, reservation, result)


class FailingPoolRead(PoolHandoff):
    receiver_type = FailingRead


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def expected(tiny):
    return [o.outputs[0].token_ids for o in LLM(tiny).generate(PROMPTS, GREEDY)]


def start(model_dir, handoff, num_p=1, num_d=1, recompute=True):
    cfg = EngineConfig(model=model_dir, block_size=16, max_model_len=512, max_num_seqs=8)
    p = [EngineActor.options(num_cpus=0).remote(cfg, "prefill", i, "nixl", 30.0)
         for i in range(num_p)]
    d = [EngineActor.options(num_cpus=0).remote(cfg, "decode", i, "nixl", 30.0)
         for i in range(num_d)]
    client = DisaggregatedClient.over(p, d, recompute, handoff, timeout_s=60.0, mode="pooled")
    asyncio.run(client.wait_ready(120))
    return client


def shutdown(client) -> None:
    for a in [*client.prefill, *client.decode, client.handoff.pool]:
        ray.kill(a)


def run_all(client, prompts, prefix, on_output=None):
    async def go():
        return await asyncio.gather(*[collect(client, f"{prefix}{i}", p, GREEDY, Route(0, 0),
                                              on_output if i == 0 else None)
                                      for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in asyncio.run(go())]


def test_killed_pool_under_load_fails_no_request(tiny, expected):
    # Under the `fail` policy even: a dead pool is not a failed prefill.
    client = start(tiny, PoolHandoff(timeout_s=30.0), recompute=False)
    try:
        assert run_all(client, PROMPTS, "w") == expected         # through the pool
        killed = []

        async def kill_pool(out):
            if not killed:
                killed.append(True)
                ray.kill(client.handoff.pool)
        # Six at once, the pool killed when the first token of the first comes back: the
        # others are then prefilling, putting or reading; every one ends exactly.
        assert run_all(client, PROMPTS, "k", kill_pool) == expected
        assert killed
        # And after it: P puts nothing, D prefills each itself.
        before = prefilled_tokens(ray.get(client.decode[0].load.remote()))
        assert run_all(client, PROMPTS[:2], "a") == expected[:2]
        assert prefilled_tokens(ray.get(client.decode[0].load.remote())) > before
    finally:
        for a in [*client.prefill, *client.decode]:
            ray.kill(a)


def test_failed_read_on_the_decoder_recomputes_exactly(tiny, expected):
    client = start(tiny, FailingPoolRead(timeout_s=30.0))
    try:
        before = prefilled_tokens(ray.get(client.decode[0].load.remote()))
        assert run_all(client, PROMPTS[:2], "f") == expected[:2]
        after = prefilled_tokens(ray.get(client.decode[0].load.remote()))
        # D prefilled the prompts itself: their tails (their full blocks it read from the pool)
        assert after - before == sum(len(p) % 16 for p in PROMPTS[:2])
        stats = ray.get(client.handoff.pool.stats.remote())
        assert stats["holds"] == 0 and stats["pinned"] == 0, stats
    finally:
        shutdown(client)


@ray.remote(num_cpus=0)
class Putter:
    """A prefill engine's side of a put, stopped between the pool's grant and the write: the
    test kills it there."""

    def __init__(self, layout):
        from transfer.registry import make_transport
        self.transport = make_transport("nixl")
        self.transport.register(layout.allocate(), layout)

    def begin(self, pool, keys, hold) -> int:
        self.pool_name = self.transport.connect(ray.get(pool.descriptor.remote()))
        ray.get(pool.connect.remote(self.transport.descriptor().encode()))
        grant = ray.get(pool.begin_put.remote(self.transport.name, keys, hold))
        return len(grant.block_ids)


def test_prefill_killed_mid_put_leaves_no_hold():
    from tests.support.kv import tiny_layout

    layout = tiny_layout(num_blocks=16)
    pool = start_pool(layout, "nixl", lease_s=1.0)
    putter = Putter.remote(layout)
    try:
        keys = prompt_keys("h", list(range(30)), layout.block_size)   # 8 blocks
        assert ray.get(putter.begin.remote(pool, keys, "h")) == len(keys)
        stats = ray.get(pool.stats.remote())
        assert stats["holds"] == 1 and stats["reserved"] == len(keys)
        ray.kill(putter)
        # Its lease on the granted blocks is not renewed: the put fails, and its hold ends.
        wait_until(lambda: ray.get(pool.stats.remote())["holds"] == 0, 10, 0.1)
        stats = ray.get(pool.stats.remote())
        assert (stats["reserved"], stats["pinned"], stats["request_blocks"]) == (0, 0, 0)
        assert stats["free"] == stats["capacity"], stats
    finally:
        ray.kill(pool)
