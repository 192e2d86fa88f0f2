"""Block allocator and KV cache manager: prefix caching, verification, eviction, accounting."""
from pd_cluster.block_allocator import BlockAllocator, hash_block, prefix_block_hashes
from pd_cluster.kv_cache_manager import KVCacheManager
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def _run_prefill(kv, req):
    cached, n = kv.find_cached_prefix(req)
    req.num_computed_tokens = n
    assert kv.can_allocate(req, req.num_tokens - n, cached)
    kv.allocate(req, req.num_tokens - n, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return n


def test_block_hashes_are_chained_and_stable():
    a = prefix_block_hashes(list(range(12)), 4)
    assert len(a) == 3
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    assert prefix_block_hashes([9] + list(range(1, 12)), 4)[1] != a[1]  # parent differs


def test_prefix_hit_reuses_blocks_but_never_covers_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = _req("a", range(12))
    assert _run_prefill(kv, first) == 0
    kv.free(first)
    same = _req("b", range(12))  # identical prompt: 3 full blocks cached, last token is not
    assert _run_prefill(kv, same) == 8
    longer = _req("c", list(range(12)) + [99])
    assert _run_prefill(kv, longer) == 12
    kv.free(same), kv.free(longer)
    assert kv.num_free_blocks == 16


def test_a_cache_salt_hits_only_prompts_of_the_same_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4)

    def salted(rid, salt):
        return Request(rid, list(range(12)), SamplingParams(cache_salt=salt))
    assert _run_prefill(kv, salted("a", "tenant-a")) == 0
    assert _run_prefill(kv, salted("b", "tenant-b")) == 0      # another tenant: no hit
    assert _run_prefill(kv, salted("c", None)) == 0            # nor unsalted
    assert _run_prefill(kv, salted("d", "tenant-a")) == 8      # its own tenant: the hit
    # The pool's and the routers' keys are the same hashes, salted alike.
    assert prefix_block_hashes(list(range(12)), 4, "tenant-a") != prefix_block_hashes(
        list(range(12)), 4, "tenant-b")
    assert prefix_block_hashes(list(range(12)), 4, None) == prefix_block_hashes(
        list(range(12)), 4)


def test_hash_hit_with_different_tokens_is_rejected():
    allocator = BlockAllocator(4)
    [block] = allocator.allocate(1)
    allocator.cache(block, 1234, [1, 2, 3, 4])
    assert allocator.lookup(1234, [1, 2, 3, 4]) is block
    assert allocator.lookup(1234, [1, 2, 3, 5]) is None  # a collision must not be served


def test_eviction_is_lazy_lru_and_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    old = _req("old", [1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 3 full
    _run_prefill(kv, old)
    kv.free(old)
    assert kv.num_free_blocks == 6           # freed, but still cached (lazy)
    new = _req("new", [50, 51, 52])          # needs 2 blocks: takes the 2 never-used ones
    _run_prefill(kv, new)
    again = _req("again", [1, 2, 3, 4, 5, 6, 9])
    assert kv.find_cached_prefix(again)[1] == 6
    other = _req("other", [60, 61, 62, 63, 64])   # 3 blocks: must evict 3 of old's 4
    _run_prefill(kv, other)
    # `old` was released tail first, so eviction took its tail and left its head block.
    assert kv.find_cached_prefix(again)[1] == 2
    kv.free(new), kv.free(other)
    assert kv.num_free_blocks == 6


def test_shared_blocks_are_ref_counted():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [1, 2, 3, 4, 6])
    _run_prefill(kv, a)
    assert _run_prefill(kv, b) == 4
    assert a.block_ids[:2] == b.block_ids[:2]
    assert kv.num_free_blocks == 8 - 4
    kv.free(a)
    assert kv.num_free_blocks == 8 - 3       # shared blocks still held by b
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_reused_blocks_come_back_as_one_ascending_run():
    """A request's new blocks are handed out in ascending order, so a range freed tail first
    (as the manager frees) and reused stays contiguous: one KV transfer descriptor per layer
    instead of one per block."""
    kv = KVCacheManager(num_blocks=60, block_size=4)
    for i in range(10):                       # wraps the free queue around twice
        req = _req(f"r{i}", range(100 * i, 100 * i + 60))   # 15 blocks
        _run_prefill(kv, req)
        ids = req.block_ids
        assert ids == list(range(ids[0], ids[0] + 15)), (i, ids)
        kv.free(req)


def test_reservations_stay_contiguous_when_growth_blocks_interleave():
    """A decode engine's pattern: each request reserves its prompt's blocks at once, then
    grows one block at a time interleaved with the others, and frees tail first. Long after
    the free queue has wrapped around, reservations still come as about one run of blocks."""
    import random
    allocator, rng = BlockAllocator(400), random.Random(0)
    running, runs = [], []
    for step in range(3000):
        if rng.random() < 0.25:
            blocks = allocator.allocate(20)
            ids = [b.block_id for b in blocks]
            runs.append(1 + sum(b != a + 1 for a, b in zip(ids, ids[1:])))
            running.append([blocks, rng.choice([4, 8, 12])])
        for r in list(running):
            r[0] += allocator.allocate(1)
            r[1] -= 1
            if r[1] == 0:
                running.remove(r)
                allocator.release(r[0][::-1])
    assert len(runs) > 400 and sum(runs[-200:]) / 200 < 2.0, runs[-20:]
