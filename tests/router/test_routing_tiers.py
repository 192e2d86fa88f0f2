"""kv_aware routing sees the KV tiers (issue 47): a prompt prefix that a replica's node holds in
its host tier scores below one the replica holds in GPU memory and above a miss; the host-tier
view follows the engines' offloaded / unloaded events, snapshot and incremental, and a new
epoch. (The events from real engines: tests/actors/test_kv_tiers.py.)"""
from __future__ import annotations

from actors.messages import PrefixReport, ReplicaLoad
from pd_cluster.block_allocator import PrefixEventLog, prefix_block_hashes
from pd_cluster.role import Role
from router.routing import HOST_HIT_COST, KvAwarePolicy, RoutingInputs

BS = 4


def report(log: PrefixEventLog, since: int) -> PrefixReport:
    log.publish()
    return PrefixReport(log.epoch, *log.changes(since))


def test_a_host_tier_hit_scores_between_a_gpu_hit_and_a_miss():
    prompt = list(range(8 * BS)) + [999]
    hashes = prefix_block_hashes(prompt[:-1], BS)
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=3, block_size=BS))
    logs = [PrefixEventLog(64) for _ in range(3)]
    for h in hashes:
        logs[0].stored(h)        # replica 0: the whole prefix on its GPU
        logs[1].offloaded(h)     # replica 1: in its node's host tier only
    # (replica 2: nothing)
    policy.observe([ReplicaLoad(role=Role.DECODE, replica_id=i, kv_blocks_total=100,
                                prefix=report(log, -1)) for i, log in enumerate(logs)])
    blocks = len(hashes) + 1
    costs = [policy.cost(Role.DECODE, i, hashes, blocks)[0] for i in range(3)]
    assert costs[0] < costs[1] < costs[2]
    assert costs == [1, 1 + HOST_HIT_COST * len(hashes), blocks]
    assert policy.route(prompt).decode_id == 0

    # The node's tier drops the prefix's second half: those blocks count as a miss again,
    # and a hit after a gap counts for nothing (hashes are chained).
    cursor = policy.prefix_cursors()[(Role.DECODE, 1)]
    for h in hashes[4:6]:
        logs[1].unloaded(h)
    policy.observe([ReplicaLoad(role=Role.DECODE, replica_id=1, kv_blocks_total=100,
                                prefix=report(logs[1], cursor))])
    assert policy.cost(Role.DECODE, 1, hashes, blocks)[0] == 1 + 4 + HOST_HIT_COST * 4

    # GPU prefix then host tier: the host part continues where the GPU part ends.
    log = PrefixEventLog(64)
    for h in hashes[:2]:
        log.stored(h)
    for h in hashes:
        log.offloaded(h)
    changes = report(log, -1)
    assert sorted(changes.stored) == sorted(hashes[:2])
    assert sorted(changes.offloaded) == sorted(hashes)
    policy.observe([ReplicaLoad(role=Role.DECODE, replica_id=2, kv_blocks_total=100,
                                prefix=changes)])
    assert policy.cost(Role.DECODE, 2, hashes, blocks)[0] == 1 + HOST_HIT_COST * 6
    # A cleared GPU cache keeps the host tier's view; a restarted engine (new epoch) drops it.
    log.cleared()
    after = report(log, changes.cursor)
    assert after.snapshot and after.stored == [] and sorted(after.offloaded) == sorted(hashes)
    policy.observe([ReplicaLoad(role=Role.DECODE, replica_id=2, kv_blocks_total=100,
                                prefix=PrefixReport(log.epoch + 1, -1, 1, [], []))])
    assert policy.cost(Role.DECODE, 2, hashes, blocks)[0] == blocks
