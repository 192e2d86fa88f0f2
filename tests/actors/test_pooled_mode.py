"""Pooled mode with real Ray actors: KV goes P → DistributedKVCache → D. Output equal to
colocated and HF for each CPU transport, a shared prefix found in the pool, and an abort, a
refused put and a killed decoder each ending with every engine and the KV pool free."""
from __future__ import annotations

import asyncio
import random

import pytest

from tests.support.engine_clients import collect as collect_outputs
from tests.support.engine_clients import prefilled_tokens
from tests.support.hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from router.routing import Route
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until

ray = pytest.importorskip("ray")
from tests.support.pooled import shutdown, start

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A partial last block, a prompt shorter than a block, a shared prefix, whole blocks only.
PROMPTS = [list(range(5, 70)), [7, 8, 9], list(range(5, 40)) + [1, 2], list(range(100, 132))]
POOL_IDLE = ("reserved", "pinned", "holds", "in_flight", "request_blocks")


async def collect(client, rid, prompt, params=GREEDY, route=Route(0, 0), on_output=None):
    return await collect_outputs(client, rid, prompt, params, route, on_output)


def run_all(client, prompts, prefix="q", route=Route(0, 0)):
    async def go():
        return await asyncio.gather(*[collect(client, f"{prefix}{i}", p, route=route)
                                      for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in asyncio.run(go())]


def pool_stats(client) -> dict:
    return ray.get(client.handoff.pool.stats.remote())


def assert_all_free(client, within_s: float = 10.0) -> None:
    """Every live engine holds no block and runs nothing; the KV pool holds nothing for any
    request (cached prefix blocks are free to evict, like an engine's cached free blocks)."""
    def free() -> bool:
        loads[:], stats[:] = asyncio.run(client.loads()), [pool_stats(client)]
        return all(ld.kv_blocks_used == 0 and ld.num_running == 0 for ld in loads) and \
            all(stats[0][k] == 0 for k in POOL_IDLE)
    loads, stats = [], []
    try:
        wait_until(free, within_s, 0.1)
    except TimeoutError:
        raise AssertionError((loads, stats[0])) from None
    stats = stats[0]
    assert stats["free"] + stats["cached"] == stats["capacity"], stats


def test_holds_keep_blocks_until_released_or_expired():
    """The pool alone, in process: what a hold pins, refuses and frees."""
    from actors.kv_pool import DistributedKVCache
    from actors.pool_index import RequestKey
    from tests.support.kv import tiny_layout
    from transfer.base import TransferError
    from transfer.registry import make_transport

    layout = tiny_layout()
    pool = DistributedKVCache(tiny_layout(num_blocks=8), "local", hold_s=0.3)
    engine = make_transport("local")
    engine.register(layout.allocate(), layout)
    pool_name = engine.connect(pool.descriptor())
    pool.connect(engine.descriptor().encode())

    def put(keys, hold):
        grant = pool.begin_put(engine.name, keys, hold)
        if grant.block_ids:
            t = engine.write(pool_name, grant.positions, grant.block_ids,
                             transfer_id=grant.transfer_id)
            engine.wait(t)
            engine.release(t)
        return pool.end_put(grant.transfer_id)

    def stats(*names):
        s = pool.stats()
        return tuple(s[n] for n in names)
    held = (b"h0", b"h1", RequestKey("r", 2))
    try:
        assert put(held, "r") == 3
        assert stats("holds", "pinned", "request_blocks") == (1, 3, 1)
        with pytest.raises(TransferError, match="no room"):  # held blocks are not evicted
            put([b"x%d" % i for i in range(6)], "r2")
        assert stats("holds", "pinned", "free") == (1, 3, 5)
        pool.release("r")
        assert stats("holds", "pinned", "request_blocks", "cached") == (0, 0, 0, 2)
        with pytest.raises(TransferError, match="released"):  # a put its abort overtook
            put(held, "r")
        assert put([b"h0", b"h1", b"h2", RequestKey("q", 3)], "q") == 2  # h0, h1 cached
        assert stats("holds", "pinned") == (1, 4)
        wait_until(lambda: stats("holds") == (0,), 5)      # past hold_s: it expires
        assert stats("holds", "pinned", "request_blocks", "cached") == (0, 0, 0, 3)
    finally:
        pool.shutdown()
        engine.close()


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def expected(tiny):
    colocated = [o.outputs[0].token_ids for o in LLM(tiny).generate(PROMPTS, GREEDY)]
    assert colocated == hf_greedy(tiny, PROMPTS, GREEDY.max_tokens)
    return colocated


@pytest.fixture(scope="module")
def nixl_pooled(ray_cluster, tiny):
    """One nixl deployment for every nixl test of the module. Two decoders, for the tests
    that read from another D or kill one (that one runs last of them)."""
    client = start(tiny, "nixl", num_decode=2)
    yield client
    shutdown(client)


@pytest.fixture(params=["nixl", "ucx", "ray"])
def pooled(request, ray_cluster, tiny):
    # ucx and ray: one test each, so stopped after it (idle engines still take some of the
    # 2 cores from whatever runs next: bench/idle_cpu.py); nixl: the module's one.
    if request.param == "nixl":
        yield request.getfixturevalue("nixl_pooled")
        return
    client = start(tiny, request.param)
    yield client
    shutdown(client)


def test_pooled_equals_colocated_equals_hf(pooled, expected):
    assert run_all(pooled, PROMPTS) == expected
    stats = pool_stats(pooled)
    assert stats["cached"] >= 6 and stats["block_bytes"] > 0  # the prompts' full blocks
    assert_all_free(pooled)


@pytest.mark.parametrize("pooled", ["nixl"], indirect=True)
def test_shared_prefix_is_read_from_the_pool(pooled, tiny):
    base = random.Random(5).sample(range(3, 500), 48)      # 3 full blocks nobody else has
    first, second = base + [1, 2, 3], base + list(range(20, 40))  # 4 full blocks + a tail
    want = [o.outputs[0].token_ids for o in LLM(tiny).generate([first, second], GREEDY)]
    before = pool_stats(pooled)
    assert asyncio.run(collect(pooled, "s0", first)).outputs[0].token_ids == want[0]
    mid = pool_stats(pooled)
    assert mid["cached"] - before["cached"] == 3     # its tail was dropped once D read it
    # Another decoder, which has none of the prefix: it reads all 5 blocks from the pool,
    # while P wrote only the 2 the pool lacked.
    out = asyncio.run(collect(pooled, "s1", second, route=Route(1, 0)))
    assert out.outputs[0].token_ids == want[1]
    after = pool_stats(pooled)
    assert after["hits"] - mid["hits"] == 5 and after["cached"] - mid["cached"] == 1
    assert_all_free(pooled)


@pytest.mark.parametrize("pooled", ["nixl"], indirect=True)
def test_refused_put_recomputes_on_the_decoder(pooled, expected):
    before = prefilled_tokens(ray.get(pooled.decode[0].load.remote()))
    # The request's hold is released before its put, as when an abort overtakes the put:
    # the pool refuses the put, so P's handover fails.
    ray.get(pooled.handoff.pool.release.remote("f0"))
    final = asyncio.run(collect(pooled, "f0", PROMPTS[0]))
    assert final.outputs[0].token_ids == expected[0]
    # D computed the prompt itself, past what its own prefix cache held.
    after = prefilled_tokens(ray.get(pooled.decode[0].load.remote()))
    assert after - before == len(PROMPTS[0]) - final.num_cached_tokens > 0
    assert_all_free(pooled)


@pytest.mark.parametrize("pooled", ["nixl"], indirect=True)
def test_aborts_at_every_stage_free_every_engine_and_the_pool(pooled):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def go():
        tasks = [asyncio.create_task(collect(pooled, f"a{i}", list(range(5, 40 + 7 * i)),
                                             params, Route(i % 2, 0))) for i in range(6)]
        # The offsets are the behaviour under test: cancels landing at different points of
        # a request's life (prefill, the put, the read, decode). Those points pass within
        # milliseconds inside the actors and cannot be watched from here without changing
        # them; what is asserted (everything free) holds wherever each cancel lands.
        for task, delay in zip(tasks, (0.0, 0.005, 0.02, 0.05, 0.1, 0.3)):
            await asyncio.sleep(delay)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(go())
    assert_all_free(pooled)


def test_killed_decoder_continues_on_another_and_frees_everything(nixl_pooled, tiny):
    """The module's nixl deployment, last of its tests: it kills decoder 0."""
    client = nixl_pooled
    prompt = list(range(10, 50))
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    want = LLM(tiny).generate([prompt], params)[0].outputs[0].token_ids

    async def kill_after_some(out):
        if len(out.outputs[0].token_ids) == 20:
            ray.kill(client.decode[0])
    final = asyncio.run(collect(client, "k", prompt, params, Route(0, 0), kill_after_some))
    assert final.outputs[0].token_ids == want
    assert ("decode", 0) in client.dead
    assert_all_free(client)


@pytest.mark.slow      # the default model in P, D and the colocated engine
def test_default_model_pooled_equals_colocated(ray_cluster, default_model_dir):
    prompt = list(range(100, 300))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    colocated = LLM(default_model_dir).generate([prompt], params)[0].outputs[0].token_ids
    client = start(default_model_dir, "nixl")
    try:
        final = asyncio.run(collect(client, "d", prompt, params))
        assert final.outputs[0].token_ids == colocated
        assert_all_free(client)
    finally:
        shutdown(client)
