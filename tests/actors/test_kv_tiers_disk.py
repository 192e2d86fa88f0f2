"""The KV tiers without Ray (issue 47): the host tier (a HostTier, the KV pool in shared memory)
writes each block it evicts to the disk tier once, reads it back with its checksum checked (a
corrupt or truncated file is dropped, never used), a new tier on the same directory finds the
old one's files; the load-or-recompute rule recomputes short prefixes. (With engines and Ray:
tests/actors/test_kv_tiers.py.)"""
from __future__ import annotations

import os

import pytest

from actors.kv_tier_disk import SUFFIX
from actors.kv_tier_host import HostTier
from pd_cluster.kv_layout import KVLayout
from pd_cluster.kv_tiers import LoadCost, Tier, TierSettings

LAYOUT = KVLayout(model="tiny", dtype="float32", num_layers=2, num_blocks=4, block_size=4,
                  num_kv_heads=1, head_dim=8)


def put(tier: HostTier, keys: list[int]) -> None:
    """Put blocks whose every value is their key, as an engine on the node does."""
    grant = tier.begin_put("", keys)
    flat = tier.kv.flatten(0, 1)
    for key, block in zip(grant.keys, grant.block_ids):
        flat[:, block] = float(key)
    assert tier.end_local(grant.transfer_id, True) == len(grant.keys)


def held(tier: HostTier, keys: list[int]) -> list[float]:
    """The value of each block of the longest held prefix of `keys` (a get)."""
    grant = tier.begin_get("", keys)
    flat = tier.kv.flatten(0, 1)
    values = [flat[:, b].unique().tolist() for b in grant.block_ids]
    tier.end_local(grant.transfer_id, True)
    assert all(len(v) == 1 for v in values)
    return [v[0] for v in values]


def test_host_tier_spills_to_disk_once_and_never_loads_a_bad_block(tmp_path):
    settings = TierSettings(host_bytes=4 * LAYOUT.bytes_per_block_id, disk_path=str(tmp_path),
                            disk_bytes=6 * (LAYOUT.bytes_per_block_id + 64))
    tier = HostTier(LAYOUT, settings, lease_s=None)
    try:
        put(tier, [1, 2, 3, 4])
        put(tier, [5, 6])                      # evicts 1 and 2 to disk
        assert tier.flush()
        assert tier.tier_lookup([1, 2, 3, 4]) == (0, 4)
        assert tier.tier_lookup([3, 4, 5]) == (3, 3)
        # Back into host memory from disk (3, 4 evicted down in their turn), bit for bit.
        assert tier.promote([1, 2]) == (2, 2) and held(tier, [1, 2]) == [1.0, 2.0]
        assert tier.flush()
        written = tier.stats()["disk_bytes_written"]
        # 5, 6, 1, 2 go down: 1 and 2 are on disk already, not rewritten.
        put(tier, [7, 8, 9, 10])
        assert tier.flush()
        stats = tier.stats()
        assert stats["disk_bytes_written"] - written == 2 * LAYOUT.bytes_per_block_id
        assert stats["disk_hits"] == 2 and stats["promoted"] == 2
        # 7 and 8 go down: past the budget of 6 files the least recently used go (1, 2: read
        # before 3 and 4 were written).
        put(tier, [11, 12])
        assert tier.flush()
        assert tier.tier_lookup([1]) == (0, 0) and tier.tier_lookup([3, 4, 5]) == (0, 3)
        assert tier.stats()["disk_evictions"] == 2

        # A corrupt block is found by its checksum, a truncated one by its size: both are
        # deleted and end the prefix there (the engine recomputes from that block on).
        files = {int(n[:-len(SUFFIX)], 16): tmp_path / os.listdir(tmp_path)[0] / n
                 for n in os.listdir(tmp_path / os.listdir(tmp_path)[0])}
        data = bytearray(files[4].read_bytes())
        data[-1] ^= 0xFF
        files[4].write_bytes(bytes(data))
        files[5].write_bytes(files[5].read_bytes()[:-8])
        assert tier.promote([3, 4]) == (1, 1) and held(tier, [3]) == [3.0]
        assert tier.promote([5]) == (0, 0)
        stats = tier.stats()
        assert stats["disk_corrupt"] == 2 and not files[4].exists() and not files[5].exists()
        assert tier.tier_lookup([4]) == (0, 0)
    finally:
        tier.shutdown()

    # The tier's death keeps its files: a new one on the directory finds them.
    again = HostTier(LAYOUT, settings, lease_s=None)
    try:
        assert again.tier_lookup([6]) == (0, 1) and again.promote([6]) == (1, 1)
        assert held(again, [6]) == [6.0]
        # Not a whole block of host memory: a clear error naming the field.
        with pytest.raises(ValueError, match="kv_tiers.host_bytes"):
            TierSettings(host_bytes=100).host_blocks(LAYOUT.bytes_per_block_id)
    finally:
        again.shutdown()


def test_the_cost_rule_recomputes_short_prefixes_and_follows_measurements():
    cost = LoadCost(TierSettings(host_gbps=1.0, disk_gbps=0.1, prefill_tokens_per_s=10_000))
    block = 64 * 2**10
    # 16 tokens: 1.6 ms of prefill against the load's 2 ms overhead: recompute.
    assert cost.saving(16, {Tier.HOST: block}) <= 0
    # 1024 tokens: 102 ms of prefill against 2 ms + 64 blocks at 1 GB/s (4 ms): load.
    assert cost.saving(1024, {Tier.HOST: 64 * block}) > 0
    # The same from disk at 0.1 GB/s (42 ms): still a load, saving less.
    assert 0 < cost.saving(1024, {Tier.DISK: 64 * block}) < cost.saving(1024,
                                                                        {Tier.HOST: 64 * block})
    # A disk measured much slower (1 MB/s): the disk part is not worth it any more.
    for _ in range(40):
        cost.loaded(Tier.DISK, 10**6, 1.0)
    assert cost.saving(1024, {Tier.DISK: 64 * block}) <= 0
    # Loads measured to take 0.2 s beyond their copies: 1024 tokens (0.1 s) are recomputed.
    slow = LoadCost(TierSettings(prefill_tokens_per_s=10_000))
    assert slow.saving(1024, {Tier.HOST: block}) > 0
    for _ in range(40):
        slow.overhead(0.2)
    assert slow.saving(1024, {Tier.HOST: block}) <= 0
    # min_load_tokens: shorter prefixes are recomputed whatever the rates.
    assert LoadCost(TierSettings(min_load_tokens=2048)).saving(1024, {Tier.HOST: 1}) <= 0
    # Unconfigured, the prefill rate follows the engine's steps.
    measured = LoadCost(TierSettings())
    measured.prefilled(50_000, 1.0)
    assert measured.prefill_tps == 50_000
