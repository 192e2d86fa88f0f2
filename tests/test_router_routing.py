"""Routing policies: kv_aware follows prefix hits and reported load like Dynamo's cost,
disaggregates only long uncached prompts, spreads a burst between two load reports;
round_robin cycles; the registry knows every name AppConfig accepts."""
from __future__ import annotations

import pytest

from pd_cluster.block_allocator import prefix_block_hashes
from router.app_config import ROUTING_POLICIES
from router.routing import (DECODE, PREFILL, KvAwarePolicy, ReplicaLoad, Route, RoutingInputs,
                            make_policy)

BS = 4


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def load(role: str, replica_id: int, used: int, total: int = 100) -> ReplicaLoad:
    return ReplicaLoad(role=role, replica_id=replica_id, kv_blocks_used=used,
                       kv_blocks_total=total)


def test_registry_knows_every_configurable_policy():
    inputs = RoutingInputs(num_prefill=1, num_decode=1, block_size=BS)
    assert {name: type(make_policy(name, inputs)).__name__ for name in ROUTING_POLICIES}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random", inputs)


def test_kv_aware_prefers_the_replica_holding_the_prefix():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=3, block_size=BS))
    policy.observe([load(DECODE, i, used=0) for i in range(3)])
    shared = prompt(1, 8)
    first = policy.route(shared + [7])
    policy.observe([load(DECODE, i, used=0) for i in range(3)])
    # Same 8-block prefix, different tail: the prefix holder wins despite equal load.
    assert policy.route(shared + [9, 9]) == first
    assert policy.route(prompt(2, 8)).decode_id != first.decode_id   # its blocks count now


def test_kv_aware_cost_is_weighted_uncached_blocks_plus_active_blocks():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=2, block_size=BS,
                                         prefill_weight=2.0))
    policy.route(prompt(1, 4) + [1])        # replica 0 records the 4-block prefix
    policy.observe([load(DECODE, 0, used=5), load(DECODE, 1, used=0)])
    hashes = prefix_block_hashes(prompt(1, 4), BS)           # 4 full blocks; 5 in all
    cost0, hit0 = policy.cost(DECODE, 0, hashes, 5)
    cost1, hit1 = policy.cost(DECODE, 1, hashes, 5)
    assert (hit0, hit1) == (4, 0)
    assert cost0 == 2.0 * (5 - 4) + 5 and cost1 == 2.0 * 5 + 0
    # Heavier load on 0 outweighs its prefix hit: 2*1 + 20 > 2*5 + 0.
    policy.observe([load(DECODE, 0, used=20), load(DECODE, 1, used=0)])
    assert policy.route(prompt(1, 4) + [1]).decode_id == 1


def test_burst_between_load_reports_is_spread():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=4, block_size=BS))
    policy.observe([load(DECODE, i, used=0) for i in range(4)])
    picks = [policy.route(prompt(10 + i, 3)).decode_id for i in range(8)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_conditional_disaggregation_keeps_short_uncached_prompts_on_decode():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=2, num_decode=2, block_size=BS,
                                         conditional_disagg_threshold=10))
    assert policy.route(prompt(1, 2)).prefill_id is None        # 8 uncached tokens < 10
    long_route = policy.route(prompt(2, 6))                     # 24 uncached tokens
    assert long_route.prefill_id is not None
    # Prefill replicas are scored by their own load: the busy one is avoided.
    policy.observe([load(PREFILL, 0, used=50), load(PREFILL, 1, used=0),
                    load(DECODE, 0, used=0), load(DECODE, 1, used=0)])
    assert policy.route(prompt(3, 6)).prefill_id == 1
    # A long prompt whose prefix D already holds leaves a short uncached part: stays on D.
    held = prompt(2, 6)
    route = policy.route(held + [5])
    assert route.prefill_id is None and route.decode_id == long_route.decode_id


def test_no_prefill_replicas_means_colocated_routes():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=1, block_size=BS))
    assert policy.route(prompt(1, 50)) == Route(decode_id=0, prefill_id=None)


def test_round_robin_cycles_each_role():
    policy = make_policy("round_robin", RoutingInputs(num_prefill=2, num_decode=3,
                                                      block_size=BS))
    routes = [policy.route(prompt(i, 1)) for i in range(6)]
    assert [r.decode_id for r in routes] == [0, 1, 2, 0, 1, 2]
    assert [r.prefill_id for r in routes] == [0, 1, 0, 1, 0, 1]
