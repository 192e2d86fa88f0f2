"""The KV cache hierarchy with real engines over real Ray (issue 47): a prompt prefix evicted
from an engine's (tiny) KV cache comes back from its node's host tier, and once the host tier
has evicted it too, from the disk tier, instead of being computed again, with the greedy
output of a cold run; in colocated and in disaggregated mode (P and D both load). A corrupt
block file is detected and its blocks recomputed; a killed engine's replacement on the node
hits the blocks it left in the host tier. (The tiers alone: tests/actors/test_kv_tiers_disk.py;
the routing score: tests/router/test_routing_tiers.py.)"""
from __future__ import annotations

import asyncio
import os
import random
import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_cluster import LLM, EngineConfig, SamplingParams
from pd_cluster.block_allocator import prefix_block_hashes
from router.app_config import AppConfig, KVTiersConfig
from router.routing import Route
from tests.support.engine_clients import collect, prefilled_tokens
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until

ray = pytest.importorskip("ray")
from actors.engine_actor import EngineActor
from actors.kv_tier_host import tier_name
from router.app import start_client
from router.disagg_client import DisaggregatedClient
from router.metrics import RouterMetrics

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 12 blocks of 16 tokens: two 8-block prompts in a row evict everything before them.
ENGINE = {"max_model_len": 128, "num_kv_blocks": 12, "max_num_seqs": 2}
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4   # layers x (K, V) x tokens x KV heads x head dim x fp32
HOST_BLOCKS = 20
OPTIONS = {"prefill": {"num_cpus": 0}, "decode": {"num_cpus": 0}}


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


def tiers(disk: str) -> dict:
    # A prefill rate of 1 token/s makes every load worth it: these tests are about where the
    # blocks come from (the rule itself: tests/actors/test_kv_tiers_disk.py).
    return {"enabled": True, "host_bytes": HOST_BLOCKS * BLOCK_BYTES, "disk_path": disk,
            "disk_bytes": 64 * BLOCK_BYTES, "prefill_tokens_per_s": 1.0}


def host_tier():
    return ray.get_actor(tier_name(ray.get_runtime_context().get_node_id()))


@pytest.fixture
def fresh_tier():
    """Each test starts and ends without the node's (detached) host tier."""
    def kill():
        try:
            ray.kill(host_tier())
        except ValueError:
            pass
    kill()
    yield
    kill()


class Prompts:
    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.a = rng.sample(range(3, 500), 4 * BS + 5)          # 4 full blocks and a tail
        self.keys = prefix_block_hashes(self.a, BS)
        self.fillers = iter([rng.sample(range(3, 500), 7 * BS + 3) for _ in range(9)])


def run(client, rid: str, prompt: list[int], route: Route) -> list[int]:
    return asyncio.run(collect(client, rid, prompt, GREEDY, route)).outputs[0].token_ids


def settle(engines) -> None:
    """Every freed block written down, and what the host tier evicted on disk."""
    for engine in engines:
        ray.get(engine.flush_tiers.remote(), timeout=30)
    assert ray.get(host_tier().flush.remote(), timeout=30)


def evict(client, prompts: Prompts, engines, route: Route, count: int) -> None:
    """Run `count` 8-block fillers: the engines' caches (and, with 3, the host tier's 20
    blocks) lose prompt A."""
    for i in range(count):
        run(client, f"fill-{id(prompts)}-{i}-{random.random()}", next(prompts.fillers), route)
        # Written down before the next: a copy in flight holds its blocks, and the next
        # filler needs 8 of the 12 (a reservation without room would make D prefill).
        settle(engines)
    for engine in engines:
        stored = set(ray.get(engine.load.remote(-1), timeout=30).prefix.stored)
        assert not stored & set(prompts.keys)


def computed(engine) -> int:
    return prefilled_tokens(ray.get(engine.load.remote(), timeout=30))


def stats(engine) -> dict:
    return ray.get(engine.tier_stats.remote(), timeout=30)


def all_free(engines) -> None:
    wait_until(lambda: all(ray.get(e.load.remote()).kv_blocks_used == 0 for e in engines),
               10, 0.1)


def test_colocated_prefix_comes_back_from_host_then_disk_never_from_a_bad_file(
        ray_cluster, tiny, tmp_path, fresh_tier):
    config = AppConfig.from_args({"mode": "colocated", "num_decode": 1,
                                  "engine": {"model": tiny, **ENGINE},
                                  "kv_tiers": tiers(str(tmp_path)),
                                  "limits": {"request_timeout_s": 30, "max_tokens": 64}})
    client = start_client(config, config.engine, OPTIONS)
    asyncio.run(client.wait_ready(120))
    engine, route = client.actors[0], Route(0)
    p = Prompts(47)
    cold = LLM(tiny).generate([p.a], GREEDY)[0].outputs[0].token_ids
    try:
        assert run(client, "a0", p.a, route) == cold
        evict(client, p, [engine], route, 2)

        # From the host tier: only the tail is computed.
        before = computed(engine)
        assert run(client, "a1", p.a, route) == cold
        assert computed(engine) - before == 5
        assert stats(engine)["host_hits"] == 4
        tier = host_tier()
        assert ray.get(tier.stats.remote())["block_bytes"] == BLOCK_BYTES

        # The host tier full of other blocks: A's went to disk, and come back from there.
        evict(client, p, [engine], route, 3)
        assert ray.get(tier.tier_lookup.remote(p.keys)) == (0, 4)
        before = computed(engine)
        assert run(client, "a2", p.a, route) == cold
        assert computed(engine) - before == 5
        assert stats(engine)["disk_hits"] == 4
        # ... which the router's metrics show, per replica and per node and tier.
        def reported():   # the host tier's stats come with the engine's mirror, every 1 s
            load = ray.get(engine.load.remote())
            return load if load.kv_tiers.get("host_tier", {}).get("promoted") else None
        load = wait_until(reported, 10, 0.1)
        metrics = RouterMetrics("tiny")
        metrics.set_loads([load])
        series = {(m.name, tuple(sorted(m.labels.items()))): m.value for f in
                  text_string_to_metric_families(metrics.render().decode())
                  for m in f.samples if m.name.startswith("pd_kv_tier_")}
        replica = (("replica", "0"), ("role", "decode"))
        assert series["pd_kv_tier_hit_blocks_total", (*replica, ("tier", "disk"))] == 4
        assert series["pd_kv_tier_hit_blocks_total", (*replica, ("tier", "host"))] == 4
        assert series["pd_kv_tier_loads_total", replica] == 2
        node = load.kv_tiers["host_tier"]["node"]
        assert series["pd_kv_tier_bytes_in_total", (("node", node), ("tier", "disk"))] > 0
        assert series["pd_kv_tier_evictions_total", (("node", node), ("tier", "host"))] > 0

        # A truncated file of A's first block: detected, the whole prompt computed.
        evict(client, p, [engine], route, 3)
        first = os.path.join(tmp_path, socket.gethostname(), f"{p.keys[0]:016x}.kvb")
        with open(first, "r+b") as f:
            f.truncate(100)
        before = computed(engine)
        assert run(client, "a3", p.a, route) == cold
        assert computed(engine) - before == len(p.a)
        assert ray.get(tier.stats.remote())["disk_corrupt"] == 1
        all_free([engine])
    finally:
        for actor in client.actors:
            ray.kill(actor)


def test_disaggregated_p_and_d_load_from_the_tiers_and_a_replacement_hits_them(
        ray_cluster, tiny, tmp_path, fresh_tier):
    cfg = EngineConfig(model=tiny, block_size=BS, **ENGINE)
    t = KVTiersConfig(**tiers(str(tmp_path)))

    def engines():
        p = EngineActor.options(num_cpus=0).remote(cfg, "prefill", 0, "nixl", 30.0, kv_tiers=t)
        d = EngineActor.options(num_cpus=0).remote(cfg, "decode", 0, "nixl", 30.0, kv_tiers=t)
        client = DisaggregatedClient.over([p], [d], True)
        asyncio.run(client.wait_ready(120))
        return client, p, d

    client, pe, de = engines()
    route = Route(0, 0)
    p = Prompts(48)
    cold = LLM(tiny).generate([p.a], GREEDY)[0].outputs[0].token_ids
    try:
        assert run(client, "a0", p.a, route) == cold
        evict(client, p, [pe, de], route, 2)

        # D reserves with A's prefix loaded from the host tier, P prefills only the tail.
        before = computed(pe)
        assert run(client, "a1", p.a, route) == cold
        assert computed(pe) - before == 5
        assert stats(pe)["host_hits"] == 4 and stats(de)["host_hits"] == 4
        assert computed(de) == 0

        # Past the host tier: from disk (D asks first and promotes them; P then finds them
        # in host memory).
        evict(client, p, [pe, de], route, 3)
        assert ray.get(host_tier().tier_lookup.remote(p.keys)) == (0, 4)
        before = computed(pe)
        assert run(client, "a2", p.a, route) == cold
        assert computed(pe) - before == 5
        # (Both may have read the disk when their lookups raced: at least one did.)
        assert stats(de)["disk_hits"] + stats(pe)["disk_hits"] >= 4
        assert ray.get(host_tier().stats.remote())["promoted"] >= 4
        all_free([pe, de])
    finally:
        ray.kill(pe)
        ray.kill(de)

    # Both engines killed: their replacements on the node start with empty caches and find
    # A in the host tier their predecessors filled.
    client, pe, de = engines()
    try:
        assert run(client, "a3", p.a, route) == cold
        assert computed(pe) == 5
        assert stats(pe)["host_hits"] + stats(de)["host_hits"] >= 4
        all_free([pe, de])
    finally:
        ray.kill(pe)
        ray.kill(de)
