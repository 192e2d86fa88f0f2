"""The KV pool in one process: its capacity from the config, LRU eviction that never takes a
held block, the same-node copy through its shared-memory segment, and its metrics."""
from __future__ import annotations

import pytest
import torch

from actors.kv_pool import DistributedKVCache
from actors.pool_handoff import PoolSettings
from actors.pool_shm import SharedSegment, block_runs, copy_blocks
from tests.support.kv import tiny_layout
from router.app_config import AppConfig
from router.metrics import RouterMetrics
from transfer.base import TransferError


@pytest.fixture
def pool():
    p = DistributedKVCache(tiny_layout(num_blocks=6), "local", shared_memory=True)
    yield p
    p.shutdown()


def copy_in(pool, keys, kv, block_ids, hold=None) -> int:
    """An engine on the pool's node puts `block_ids` of `kv` under `keys` by a copy."""
    grant = pool.begin_put("engine", keys, hold)
    seg = SharedSegment.attach(pool.shared(), pool.node())
    copy_blocks(kv, seg.kv, [block_ids[i] for i in grant.positions], grant.block_ids)
    return pool.end_local(grant.transfer_id, True)


def test_capacity_comes_from_blocks_or_bytes_and_is_validated():
    config = AppConfig.from_args({"mode": "pooled", "kv_pool": {"capacity_bytes": 10_000}})
    assert PoolSettings.of(config.kv_pool).num_blocks(block_bytes=1024, default=7) == 9
    assert PoolSettings(capacity_blocks=3).num_blocks(1024, 7) == 3
    assert PoolSettings().num_blocks(1024, 7) == 7          # an engine's KV cache
    with pytest.raises(ValueError, match="kv_pool.capacity_bytes: 100 is below one KV block"):
        PoolSettings(capacity_bytes=100).num_blocks(1024, 7)
    with pytest.raises(ValueError, match="kv_pool: set capacity_blocks or capacity_bytes, not"):
        AppConfig.from_args({"kv_pool": {"capacity_bytes": 1, "capacity_blocks": 1}})
    with pytest.raises(ValueError, match="kv_pool.placement"):
        AppConfig.from_args({"kv_pool": {"placement": "everywhere"}})


def test_copies_land_in_the_pools_memory_and_come_back(pool):
    layout = tiny_layout()
    kv = torch.randn(layout.shape).to(layout.torch_dtype)
    assert copy_in(pool, [b"a", b"b", b"c"], kv, [5, 6, 9]) == 3
    grant = pool.begin_get("engine", [b"a", b"b", b"c", b"d"])
    assert len(grant.block_ids) == 3                 # the cached prefix: a, b, c
    out = torch.zeros_like(kv)
    copy_blocks(SharedSegment.attach(pool.shared(), pool.node()).kv, out, grant.block_ids,
                [0, 1, 2])
    assert pool.end_local(grant.transfer_id, True) == 3
    assert torch.equal(out[:, :, :3], kv[:, :, [5, 6, 9]])
    stats = pool.stats()
    assert stats["bytes_in"] == stats["bytes_out"] == stats["bytes_copied"] // 2 > 0
    assert (stats["pinned"], stats["reserved"]) == (0, 0)


def test_a_failed_copy_frees_its_blocks(pool):
    grant = pool.begin_put("engine", [b"x", b"y"])
    with pytest.raises(TransferError):
        pool.end_local(grant.transfer_id, False)
    stats = pool.stats()
    assert (stats["free"], stats["cached"], stats["reserved"]) == (6, 0, 0)


def test_lru_eviction_takes_the_oldest_unheld_block_never_a_held_one(pool):
    kv = tiny_layout().allocate()
    copy_in(pool, [b"h1", b"h2"], kv, [0, 1], hold="r")      # held for a reader
    copy_in(pool, [b"o1", b"o2"], kv, [2, 3])
    copy_in(pool, [b"n1", b"n2"], kv, [4, 5])
    assert pool.lookup([b"o1"]) == 1
    pool.begin_get("engine", [b"o1"])                         # o1 is now the most recent
    copy_in(pool, [b"z1", b"z2"], kv, [6, 7])                  # full: two must go
    cached = pool.index.cached
    assert {b"h1", b"h2", b"o1", b"z1", b"z2"} <= set(cached) and b"o2" not in cached
    assert pool.stats()["evictions"] == 2
    with pytest.raises(TransferError, match="no room"):        # held and pinned blocks stay
        copy_in(pool, [b"q%d" % i for i in range(6)], kv, list(range(6)), hold="q")


def test_block_runs_merge_where_both_sides_are_consecutive():
    assert block_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]


def test_pool_stats_are_exported_per_node(pool):
    copy_in(pool, [b"a"], tiny_layout().allocate(), [0])
    metrics = RouterMetrics("m")
    metrics.set_kv_pools({"node-1": pool.stats()})
    text = metrics.render().decode()
    block = pool.stats()["block_bytes"]
    assert f'pd_kv_pool_bytes_in_total{{node="node-1"}} {float(block)}' in text
    for name in ("bytes_out_total", "hits_total", "evictions_total", "holds", "pinned",
                 "capacity_bytes"):
        assert f"pd_kv_pool_{name}{{" in text


def test_blocks_imported_into_an_engine_become_its_prefix_hit():
    """The engine's side of prefix reuse (KVCacheManager): blocks read from the pool, indexed
    under the prompt's hashes, are what the scheduler then finds cached."""
    from pd_cluster.kv_cache_manager import KVCacheManager
    from pd_cluster.request import Request
    from pd_cluster.sampling_params import SamplingParams

    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(14))                          # 3 full blocks and 2 tokens
    assert kv.hold_cached_prefix(tokens) == []
    assert kv.blocks_for_import(9) == []              # no room: no import, nothing taken
    blocks = kv.blocks_for_import(3)
    kv.cache_imported(tokens, 0, blocks)
    hits, num_cached = kv.find_cached_prefix(Request("r", tokens, SamplingParams()))
    assert hits == blocks and num_cached == 12
    held = kv.hold_cached_prefix(tokens + [99])       # another prompt with that prefix
    assert held == blocks and all(b.ref_count == 2 for b in blocks)
    kv.release_blocks(blocks)
    kv.release_blocks(held)
    assert kv.num_free_blocks == 8                    # free, and still cached
    assert kv.find_cached_prefix(Request("s", tokens, SamplingParams()))[1] == 12
