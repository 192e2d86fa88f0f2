"""DistributedKVCache: LRU block index by prefix hash, and real KV blocks moving engine → pool →
engine byte-exact with each CPU-capable backend; a killed client, an abort and an expired
lease each end in a clear error with no block left reserved or pinned."""
from __future__ import annotations

import pytest
import torch

from actors.kv_pool import BlockIndex, DistributedKVCache
from tests.support.kv import FreeList, blocks, model_kv, paged_kv, tiny_layout
from transfer.base import TransferError

ray = pytest.importorskip("ray")
from actors.pool_client import BlockingPoolClient  # noqa: E402

BACKENDS = ["nixl", "ucx", "ray"]
LAYOUT = tiny_layout()
POOL_LAYOUT = tiny_layout(num_blocks=8)
KEYS = [b"h0", b"h1", b"h2", b"h3", b"h4", b"h5"]

# Short, so that the tests that wait for a lease to expire end soon; not 1 s: renewals come
# every lease / 3, and on a loaded 2-core machine a Ray actor's renewal was once more than 1 s
# late, so a put expired before the test's kill (test_a_pool_killed_mid_get_fails_the_reader_
# cleanly[ray], "stopped renewing its lease (1s)").
TEST_LEASE_S = 3.0


def test_index_evicts_least_recently_used_unpinned_blocks() -> None:
    ix = BlockIndex(4)
    ix.insert(["a", "b", "c"], ix.allocate(3))
    assert ix.prefix(["a", "x", "b"]) == [0] and (ix.hits, ix.misses) == (1, 2)  # stops at x
    ix.pin([ix.cached["b"]], +1)
    ix.insert(["d", "e", "f"], ix.allocate(3))  # 1 free block + evict c, then a (b is pinned)
    assert list(ix.cached) == ["b", "d", "e", "f"] and ix.evictions == 2
    assert len(ix.allocate(5)) == 3 and list(ix.cached) == ["b"]  # pinned blocks stay


class PoolUser:
    """An engine using the pool: its own paged KV, free list and transport."""

    def __init__(self, backend: str, kv_tokens: torch.Tensor | None = None):
        from transfer.registry import make_transport

        self.alloc = FreeList(LAYOUT.num_blocks)
        self.prompt = self.alloc.allocate(6 if kv_tokens is not None else 0)
        self.kv = paged_kv(LAYOUT, kv_tokens, self.prompt) if kv_tokens is not None \
            else LAYOUT.allocate()
        self.t = make_transport(backend, timeout_s=5.0, lease_s=TEST_LEASE_S)
        self.t.register(self.kv, LAYOUT)
        self.client, self.grant = None, None

    def attach(self, pool) -> None:
        self.client = BlockingPoolClient(pool, self.t)

    def put(self, keys: list) -> int:
        return self.client.put(keys, self.prompt)

    def get(self, keys: list) -> tuple[int, torch.Tensor]:
        ids = self.alloc.allocate(len(keys))
        try:
            n = self.client.get(keys, ids)
            return n, blocks(self.kv, ids[:n])
        finally:
            self.alloc.free(ids)  # a real engine keeps them for the request

    def begin(self, kind: str, keys: list) -> str:
        """The first step of a put/get alone, to break things between the steps."""
        self.grant = self.client._call(f"begin_{kind}", self.t.name, keys)
        return self.grant.transfer_id

    def complete(self, kind: str) -> str:
        """The rest of a begun put/get; the error text, or "" on success."""
        ids = self.alloc.allocate(len(self.grant.block_ids)) if kind == "get" else self.prompt
        start = self.t.write if kind == "put" else self.t.read
        try:
            self.client._move(start, self.grant, ids)
            self.client._call(f"end_{kind}", self.grant.transfer_id)
            return ""
        except TransferError as e:
            return str(e)
        finally:
            if kind == "get":
                self.alloc.free(ids)

    def leaked_blocks(self) -> int:
        return self.alloc.num_blocks - len(self.prompt) - self.alloc.num_free


RemoteUser = ray.remote(num_cpus=0)(PoolUser)
RemotePool = ray.remote(num_cpus=0, max_concurrency=8)(DistributedKVCache)


@pytest.fixture(scope="module")
def kv() -> torch.Tensor:
    return model_kv(LAYOUT, 24, seed=11)


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, ray_cluster, kv):
    pool = RemotePool.remote(POOL_LAYOUT, request.param, timeout_s=5.0, lease_s=TEST_LEASE_S)
    writer, reader = RemoteUser.remote(request.param, kv), RemoteUser.remote(request.param)
    ray.get([writer.attach.remote(pool), reader.attach.remote(pool)])
    yield request.param, pool, writer, reader
    stats = ray.get(pool.stats.remote())
    assert (stats["reserved"], stats["pinned"], stats["in_flight"]) == (0, 0, 0), stats
    assert stats["free"] + stats["cached"] == stats["capacity"]
    assert ray.get([writer.leaked_blocks.remote(), reader.leaked_blocks.remote()]) == [0, 0]
    ray.get(pool.shutdown.remote())
    for a in (pool, writer, reader):
        ray.kill(a)


def test_put_then_get_through_the_pool_is_byte_exact(cluster, kv) -> None:
    _, pool, writer, reader = cluster
    assert ray.get(writer.put.remote(KEYS)) == 6
    assert ray.get(writer.put.remote(KEYS)) == 0  # already cached: nothing moves
    n, got = ray.get(reader.get.remote(KEYS[:4] + [b"miss", KEYS[5]]))
    assert n == 4 and torch.equal(got, paged_kv(LAYOUT, kv, list(range(6)))[:, :, :4])
    stats = ray.get(pool.stats.remote())
    assert (stats["cached"], stats["hits"], stats["misses"]) == (6, 4, 2)


def test_full_pool_evicts_least_recently_used_prefixes(cluster) -> None:
    _, pool, writer, _ = cluster
    ray.get(writer.put.remote(KEYS))
    assert ray.get(writer.put.remote([b"n0", b"n1", b"n2", b"n3"])) == 4  # 8-block pool
    assert ray.get(writer.put.remote([b"n0", b"n1", b"n2", b"n3"])) == 0  # all still cached
    assert ray.get(pool.stats.remote())["evictions"] >= 2


def test_abort_by_the_pool_fails_the_put_and_frees_its_blocks(cluster) -> None:
    _, pool, writer, reader = cluster
    tid = ray.get(writer.begin.remote("put", [b"a0", b"a1"]))
    ray.get(pool.abort.remote(tid, "pool is draining"))
    assert "pool is draining" in ray.get(writer.complete.remote("put"))
    assert ray.get(reader.get.remote([b"a0"]))[0] == 0      # never cached


def test_an_expired_lease_frees_a_stalled_put(cluster) -> None:
    _, pool, writer, _ = cluster
    tid = ray.get(writer.begin.remote("put", [b"s0", b"s1"]))  # and never writes
    with pytest.raises(TransferError, match="stopped renewing its lease"):
        ray.get(pool.end_put.remote(tid))


# Over nixl alone: what ends the killed client's put is the lease expiry of the transports'
# common logic (transfer/base.py), which test_an_expired_lease_frees_a_stalled_put asserts
# over each backend. (nixl is index 0 of BACKENDS, as it must be here: pytest groups the
# tests by the index of the module fixture's parameter.)
@pytest.mark.parametrize("cluster", ["nixl"], indirect=True)
def test_a_client_killed_mid_put_leaks_nothing(cluster, kv) -> None:
    backend, pool, _, _ = cluster
    doomed = RemoteUser.remote(backend, kv)
    ray.get(doomed.attach.remote(pool))
    tid = ray.get(doomed.begin.remote("put", [b"k0", b"k1", b"k2"]))
    ray.kill(doomed)
    with pytest.raises(TransferError, match="stopped renewing"):
        ray.get(pool.end_put.remote(tid))


def test_a_pool_killed_mid_get_fails_the_reader_cleanly(cluster) -> None:
    backend, pool, writer, reader = cluster
    doomed = RemotePool.remote(POOL_LAYOUT, backend, timeout_s=5.0, lease_s=TEST_LEASE_S)
    # Started before the users call it: their calls give up after 5 s, and an actor's start
    # (its imports) took longer than that on a loaded 2-core machine.
    ray.get(doomed.stats.remote(), timeout=120)
    ray.get([writer.attach.remote(doomed), reader.attach.remote(doomed)])
    try:
        ray.get(writer.put.remote(KEYS[:3]))
        ray.get(reader.begin.remote("get", KEYS[:3]))
        ray.kill(doomed)
        err = ray.get(reader.complete.remote("get"))
        assert "died" in err or "timed_out" in err or "failed" in err, err
    finally:   # the module's users go back to its pool, whatever happened here
        ray.get([writer.attach.remote(pool), reader.attach.remote(pool)])
