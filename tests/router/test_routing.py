"""Routing policies: kv_aware follows the engines' prefix reports, its own recent routes and
reported load like Dynamo's cost, disaggregates only long uncached prompts, spreads a burst
between two load reports, picks only available replicas; round_robin cycles over the
available ones; the registry knows every name AppConfig accepts. (Reports from real engines:
tests/actors/test_prefix_reports.py.)"""
from __future__ import annotations

import pytest

from actors.messages import PrefixReport
from pd_cluster.block_allocator import prefix_block_hashes
from pd_cluster.role import Role
from router.app_config import ROUTING_POLICIES
from router.routing import (ROUTE_TTL_S, KvAwarePolicy, NoReplicaAvailable, ReplicaLoad,
                            ReplicaPrefixes, Route, RoutingInputs, make_policy)

BS = 4


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def load(role: Role, replica_id: int, used: int, total: int = 100,
         prefix: PrefixReport | None = None) -> ReplicaLoad:
    return ReplicaLoad(role=role, replica_id=replica_id, kv_blocks_used=used,
                       kv_blocks_total=total, prefix=prefix)


def snapshot(hashes: list[int], cursor: int = 10, epoch: int = 1) -> PrefixReport:
    return PrefixReport(epoch, -1, cursor, list(hashes), [])


def held(tokens: list[int]) -> list[int]:
    """The hashes a replica holding `tokens` reports (and routing looks up)."""
    return prefix_block_hashes(tokens, BS)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_registry_knows_every_configurable_policy():
    inputs = RoutingInputs(num_prefill=1, num_decode=1, block_size=BS)
    assert {name: type(make_policy(name, inputs)).__name__ for name in ROUTING_POLICIES}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random", inputs)


def test_kv_aware_prefers_the_replica_holding_the_prefix():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=3, block_size=BS))
    policy.observe([load(Role.DECODE, i, used=0) for i in range(3)])
    shared = prompt(1, 8)
    first = policy.route(shared + [7])
    policy.observe([load(Role.DECODE, i, used=0) for i in range(3)])
    # Same 8-block prefix, different tail: the prefix holder wins despite equal load.
    assert policy.route(shared + [9, 9]) == first
    assert policy.route(prompt(2, 8)).decode_id != first.decode_id   # its blocks count now


def test_kv_aware_cost_is_weighted_uncached_blocks_plus_active_blocks():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=2, block_size=BS,
                                         prefill_weight=2.0))
    policy.route(prompt(1, 4) + [1])        # replica 0 records the 4-block prefix
    policy.observe([load(Role.DECODE, 0, used=5), load(Role.DECODE, 1, used=0)])
    hashes = prefix_block_hashes(prompt(1, 4), BS)           # 4 full blocks; 5 in all
    cost0, hit0 = policy.cost(Role.DECODE, 0, hashes, 5)
    cost1, hit1 = policy.cost(Role.DECODE, 1, hashes, 5)
    assert (hit0, hit1) == (4, 0)
    assert cost0 == 2.0 * (5 - 4) + 5 and cost1 == 2.0 * 5 + 0
    # Heavier load on 0 outweighs its prefix hit: 2*1 + 20 > 2*5 + 0.
    policy.observe([load(Role.DECODE, 0, used=20), load(Role.DECODE, 1, used=0)])
    assert policy.route(prompt(1, 4) + [1]).decode_id == 1


def test_burst_between_load_reports_is_spread():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=4, block_size=BS))
    policy.observe([load(Role.DECODE, i, used=0) for i in range(4)])
    picks = [policy.route(prompt(10 + i, 3)).decode_id for i in range(8)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_conditional_disaggregation_keeps_short_uncached_prompts_on_decode():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=2, num_decode=2, block_size=BS,
                                         conditional_disagg_threshold=10))
    assert policy.route(prompt(1, 2)).prefill_id is None        # 8 uncached tokens < 10
    long_route = policy.route(prompt(2, 6))                     # 24 uncached tokens
    assert long_route.prefill_id is not None
    # Prefill replicas are scored by their own load: the busy one is avoided.
    policy.observe([load(Role.PREFILL, 0, used=50), load(Role.PREFILL, 1, used=0),
                    load(Role.DECODE, 0, used=0), load(Role.DECODE, 1, used=0)])
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


def test_reports_alone_send_a_prefix_to_the_replica_holding_it():
    """Another router's route: this one never saw it, only D2's report."""
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=3, block_size=BS))
    shared = prompt(1, 8)
    policy.observe([load(Role.DECODE, i, used=0, prefix=snapshot(held(shared) if i == 2 else []))
                    for i in range(3)])
    assert policy.route(shared + [7, 7]) == Route(2)
    assert policy.prefix_cursors() == {(Role.DECODE, i): 10 for i in range(3)}


def test_incremental_reports_add_and_remove_hashes():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=1, block_size=BS))
    assert policy.prefix_cursors() == {(Role.DECODE, 0): -1}         # knows nothing: a snapshot
    a, b = held(prompt(1, 4)), held(prompt(2, 4))
    policy.observe([load(Role.DECODE, 0, 0, prefix=snapshot(a, cursor=5))])
    policy.observe([load(Role.DECODE, 0, 0, prefix=PrefixReport(1, 5, 9, b, a[2:]))])
    assert policy.cost(Role.DECODE, 0, a, 5)[1] == 2 and policy.cost(Role.DECODE, 0, b, 5)[1] == 4
    assert policy.prefix_cursors() == {(Role.DECODE, 0): 9}
    # A report older than what was applied (two polls overlapped) changes nothing.
    policy.observe([load(Role.DECODE, 0, 0, prefix=PrefixReport(1, 5, 7, a, []))])
    assert policy.cost(Role.DECODE, 0, a, 5)[1] == 2
    assert policy.prefix_cursors()[(Role.DECODE, 0)] == 9
    # Changes after a cursor newer than ours leave a gap: the next poll asks a snapshot.
    policy.observe([load(Role.DECODE, 0, 0, prefix=PrefixReport(1, 12, 14, [], b[3:]))])
    assert policy.prefix_cursors()[(Role.DECODE, 0)] == -1
    policy.observe([load(Role.DECODE, 0, 0, prefix=snapshot(b, cursor=20))])
    assert policy.cost(Role.DECODE, 0, a, 5)[1] == 0 and policy.cost(Role.DECODE, 0, b, 5)[1] == 4
    assert policy.prefix_cursors()[(Role.DECODE, 0)] == 20


def test_a_new_epoch_replaces_what_was_known():
    prefixes = ReplicaPrefixes(capacity=100)
    a, b = held(prompt(1, 4)), held(prompt(2, 4))
    prefixes.apply(snapshot(a, cursor=50, epoch=1), now=0.0)
    # A restarted engine answers our old cursor with changes of its own: what we knew of
    # its predecessor is void, and this is not all it holds, so a snapshot is asked next.
    prefixes.apply(PrefixReport(2, 50, 60, b[:1], []), now=0.0)
    assert prefixes.cached == set(b[:1]) and prefixes.cursor == -1
    prefixes.apply(snapshot(b, cursor=3, epoch=3), now=0.0)      # its cursor starts over
    assert prefixes.cached == set(b) and (prefixes.epoch, prefixes.cursor) == (3, 3)


def test_own_routes_count_until_a_report_lists_them_or_they_expire():
    clock = Clock()
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=2, block_size=BS),
                           clock=clock)
    def reports(busy: int) -> list[ReplicaLoad]:          # empty caches, one busy replica
        return [load(Role.DECODE, i, used=int(i == busy), prefix=snapshot([])) for i in range(2)]
    policy.observe(reports(busy=0))
    shared = prompt(1, 6)
    assert policy.route(shared + [1]) == Route(1)
    policy.observe(reports(busy=1))                      # D1's report does not list it yet
    assert policy.route(shared + [2]) == Route(1)        # the prefix outweighs the load
    clock.now += ROUTE_TTL_S + 1                         # never reported: a guess gone stale
    policy.observe(reports(busy=1))
    assert policy.route(shared + [3]) == Route(0)
    prefixes = ReplicaPrefixes(capacity=100)
    prefixes.add_route(held(shared), now=0.0)
    prefixes.apply(PrefixReport(1, -1, 4, held(shared)[:3], []), now=1.0)
    assert list(prefixes.routed) == held(shared)[3:]     # reported ones are no longer guesses
    assert prefixes.overlap(held(shared), now=1.0) == 6
    prefixes.add_route(held(prompt(2, 200)), now=2.0)    # bounded by the replica's blocks
    assert len(prefixes.routed) == 100


def test_only_available_replicas_are_picked():
    policy = KvAwarePolicy(RoutingInputs(num_prefill=2, num_decode=2, block_size=BS,
                                         conditional_disagg_threshold=4))
    policy.set_available({(Role.DECODE, 1), (Role.PREFILL, 1)})
    assert policy.route(prompt(1, 6)) == Route(1, 1)
    assert policy.route(prompt(2, 6)) == Route(1, 1)     # busier, but the only ones
    policy.set_available({(Role.DECODE, 0)})                  # no prefill: D prefills it itself
    assert policy.route(prompt(3, 6)) == Route(0)
    policy.set_available({(Role.DECODE, 5), (Role.PREFILL, 0)})    # a replica the policy never saw
    assert policy.route(prompt(4, 6)) == Route(5, 0)
    assert policy.prefix_cursors()[(Role.DECODE, 5)] == -1
    policy.set_available([])
    with pytest.raises(NoReplicaAvailable):
        policy.route(prompt(5, 6))
    with pytest.raises(ValueError, match="unknown replica role"):
        policy.set_available({("router", 0)})


def test_round_robin_cycles_over_the_available_replicas():
    policy = make_policy("round_robin", RoutingInputs(num_prefill=2, num_decode=3,
                                                      block_size=BS))
    assert policy.prefix_cursors() == {}                 # needs no prefix reports
    policy.set_available({(Role.DECODE, 0), (Role.DECODE, 2), (Role.PREFILL, 0), (Role.PREFILL, 1)})
    assert [policy.route(prompt(i, 1)) for i in range(3)] == [Route(0, 0), Route(2, 1),
                                                              Route(0, 0)]
    policy.set_available({(Role.DECODE, 1)})
    assert policy.route(prompt(9, 1)) == Route(1)
    policy.set_available({(Role.PREFILL, 0)})
    with pytest.raises(NoReplicaAvailable):
        policy.route(prompt(9, 1))
