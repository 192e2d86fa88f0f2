"""Engines report their prefix caches to routers (EngineLoop.load(prefix_since)): the block
hashes a router computes from a prompt, as changes after a cursor or as a snapshot, evictions
as removals, a new epoch per engine instance; two routers fed those reports, each seeing only
its own routes, send a prompt to the replica that holds its prefix. Real engines on the CPU."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from actors.engine_loop import EngineLoop
from actors.messages import PrefixReport, ReplicaLoad
from pd_cluster.block_allocator import prefix_block_hashes
from pd_cluster.config import EngineConfig
from pd_cluster.kv_cache_manager import KVCacheManager
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import Request
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from router.routing import KvAwarePolicy, NoReplicaAvailable, Route, RoutingInputs
from tests.support.tiny_models import VOCAB, make_tiny_model

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_root: str) -> str:
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture
def make_loop(model: str):
    """Starts decode-role EngineLoops (replica id, KV blocks); shuts them down afterwards."""
    started: list[EngineLoop] = []

    def make(replica_id: int = 0, num_kv_blocks: int = 24) -> EngineLoop:
        config = EngineConfig(model=model, block_size=BS, num_kv_blocks=num_kv_blocks,
                              max_model_len=128, max_num_seqs=8, cuda_graphs=False,
                              device="cpu")
        started.append(EngineLoop(config, 30.0, Role.DECODE, replica_id))
        return started[-1]
    yield make
    for loop in started:
        loop.shutdown()


def settle(loop: EngineLoop) -> None:
    """Publish what the engine thread has recorded so far, on that thread: it would at the
    end of its current pass anyway, just after a test may have looked."""
    asyncio.run(asyncio.wait_for(loop.call(lambda engine: loop.prefix_events.publish()), 30))


def serve(loop: EngineLoop, request_id: str, prompt: list[int]) -> RequestOutput:
    """Run a prompt to its end; its blocks stay in the prefix cache."""
    async def go() -> RequestOutput:
        outs = [out async for out in loop.stream(request_id, prompt, GREEDY)]
        return outs[-1]
    final = asyncio.run(asyncio.wait_for(go(), 60))
    settle(loop)
    return final


def report(loop: EngineLoop, since: int) -> PrefixReport:
    prefix = loop.load(since).prefix
    assert prefix is not None
    return prefix


def poll(policy: KvAwarePolicy, loops: list[EngineLoop]) -> list[ReplicaLoad]:
    """What the router's LoadMonitor does through its EngineClient, one round."""
    cursors = policy.prefix_cursors()
    loads = [loop.load(cursors.get((loop.role, loop.replica_id))) for loop in loops]
    policy.observe(loads)
    return loads


def test_reports_hold_the_hashes_routing_computes(make_loop):
    loop = make_loop()
    assert loop.load().prefix is None                  # the cheap call carries none
    empty = report(loop, -1)
    assert empty == PrefixReport(empty.epoch, -1, 0, [], [])
    prompt = tokens(1, 22)
    out = serve(loop, "a", prompt).outputs[0].token_ids
    snap = report(loop, -1)
    assert snap.snapshot and snap.epoch == empty.epoch and snap.cursor > 0
    # Every full block computed: the prompt's and those of the tokens generated after it
    # (the last generated token is never computed).
    assert sorted(snap.stored) == sorted(prefix_block_hashes(prompt + out[:-1], BS))
    assert set(prefix_block_hashes(prompt[:-1], BS)) <= set(snap.stored)   # what routing hashes


def test_incremental_reports_continue_a_snapshot(make_loop):
    loop = make_loop()
    serve(loop, "a", tokens(1, 22))
    snap = report(loop, -1)
    assert report(loop, snap.cursor) == PrefixReport(snap.epoch, snap.cursor, snap.cursor,
                                                     [], [])
    second = tokens(2, 13)
    serve(loop, "b", second)
    changes = report(loop, snap.cursor)
    assert not changes.snapshot and changes.since == snap.cursor
    assert changes.cursor > snap.cursor
    assert set(prefix_block_hashes(second[:-1], BS)) <= set(changes.stored)
    # (The allocator takes free runs next to the blocks just freed, which may evict some.)
    assert set(report(loop, -1).stored) == (set(snap.stored) | set(changes.stored)) - set(
        changes.removed)
    # A cursor past the engine's (one of another engine instance) gets a snapshot.
    assert report(loop, changes.cursor + 100).snapshot


def test_eviction_shows_up_as_removed(make_loop):
    loop = make_loop(num_kv_blocks=16)
    first = tokens(1, 30)
    serve(loop, "a", first)
    before = report(loop, -1)
    for i, seed in enumerate((2, 3)):        # 9 blocks each of a 16-block cache
        serve(loop, f"b{i}", tokens(seed, 30))
    changes = report(loop, before.cursor)
    assert changes.removed and set(changes.removed) <= set(before.stored)
    after = report(loop, -1)
    # The changes carry a snapshot to the next one exactly.
    assert set(after.stored) == (set(before.stored) | set(changes.stored)) - set(
        changes.removed)
    # A router applying them no longer counts the evicted blocks of `first`'s prefix.
    policy = KvAwarePolicy(RoutingInputs(num_prefill=0, num_decode=1, block_size=BS))
    hashes = prefix_block_hashes(first[:-1], BS)
    policy.observe([loop.load(-1)])
    held = policy.cost(Role.DECODE, 0, hashes, 8)[1]
    assert held < len(hashes)
    assert held == next((i for i, h in enumerate(hashes) if h not in after.stored), len(hashes))


def test_a_log_that_no_longer_reaches_back_answers_a_snapshot(make_loop):
    loop = make_loop()
    loop.prefix_events.capacity = 2            # keeps 2 to 4 events
    start = report(loop, -1).cursor
    serve(loop, "a", tokens(1, 22))            # 6 blocks stored
    late = report(loop, start)
    assert late.snapshot and len(late.stored) == 6
    recent = report(loop, late.cursor - 1)
    assert not recent.snapshot and len(recent.stored) == 1
    # A cleared cache: every older cursor gets the (empty) snapshot.
    asyncio.run(loop.call(lambda engine: engine.kv.allocator.reset_prefix_cache()))
    settle(loop)
    cleared = report(loop, late.cursor)
    assert cleared.snapshot and cleared.stored == [] and cleared.cursor > late.cursor


def test_a_decode_engine_reports_the_prompt_it_received(make_loop):
    """Disaggregated: D reserves the prompt's blocks, the KV lands (here: nothing is written,
    the test only follows the blocks), D resumes it; then it holds the prompt's blocks."""
    loop = make_loop()
    prompt = tokens(4, 17)

    async def receive() -> None:
        await loop.call(lambda engine: engine.reserve(prompt, GREEDY, "r"))
        queue: asyncio.Queue = asyncio.Queue()
        loop.resume_into("r", 7, None, queue)
        while not (await asyncio.wait_for(queue.get(), 30))[1].finished:
            pass
    asyncio.run(receive())
    settle(loop)
    assert set(prefix_block_hashes(prompt, BS)) <= set(report(loop, -1).stored)


def test_two_routers_route_a_shared_prefix_where_the_other_sent_it(make_loop):
    loops = [make_loop(0), make_loop(1)]
    inputs = RoutingInputs(num_prefill=0, num_decode=2, block_size=BS)
    router_a, router_b = KvAwarePolicy(inputs), KvAwarePolicy(inputs)
    assert router_b.prefix_cursors() == {(Role.DECODE, 0): -1, (Role.DECODE, 1): -1}
    poll(router_a, loops), poll(router_b, loops)
    shared = tokens(5, 24)                     # 6 blocks
    first, second = shared + tokens(6, 5), shared + tokens(7, 7)
    router_a.route(tokens(8, 12))              # a burst on router a: this one takes D0...
    assert router_a.route(first) == Route(1)   # ...so `first` goes to D1
    assert router_a.route(second) == Route(1)  # its own route counts before any report
    serve(loops[1], "first", first)
    hashes = prefix_block_hashes(second[:-1], BS)
    blocks = -(-len(second) // BS)
    assert router_b.cost(Role.DECODE, 1, hashes, blocks)[1] == 0     # b has not heard yet

    poll(router_a, loops), poll(router_b, loops)
    assert router_b.cost(Role.DECODE, 1, hashes, blocks)[1] == 6
    assert router_b.route(second) == Route(1)
    assert serve(loops[1], "second", second).num_cached_tokens == 24
    loads = poll(router_b, loops)
    assert router_b.prefix_cursors()[(Role.DECODE, 1)] == loads[1].prefix.cursor > 0

    # Only the available replicas are candidates.
    router_b.set_available({(Role.DECODE, 0)})
    assert router_b.route(second) == Route(0)
    router_b.set_available(set())
    with pytest.raises(NoReplicaAvailable):
        router_b.route(second)
    router_b.set_available({(Role.DECODE, 0), (Role.DECODE, 1)})

    # D1 restarts: its first report, under a new epoch, replaces all b knew of it.
    old_epoch = report(loops[1], -1).epoch
    loops[1].shutdown()
    loops[1] = make_loop(1)
    fresh = poll(router_b, loops)[1].prefix
    assert fresh.epoch != old_epoch and fresh.snapshot and fresh.stored == []
    assert router_b.cost(Role.DECODE, 1, hashes, blocks)[1] == 0
    assert router_b.prefix_cursors()[(Role.DECODE, 1)] == fresh.cursor


def test_a_router_following_the_changes_tracks_the_cache_exactly():
    """A KV cache manager evicting under churn, its events published by one thread while
    another reads changes with a log that overflows now and then: applying them (snapshots
    included) always ends at the cache's own index."""
    kv = KVCacheManager(num_blocks=40, block_size=BS)
    log = kv.allocator.record_events(capacity=16)
    rng = random.Random(0)
    prefixes = [tokens(seed, 24) for seed in range(6)]
    done = threading.Event()

    def engine() -> None:
        running: list[Request] = []
        for i in range(600):
            if len(running) > 3 or (running and rng.random() < 0.4):
                kv.free(running.pop(rng.randrange(len(running))))
            else:
                req = Request(f"r{i}", rng.choice(prefixes)[:rng.randrange(5, 25)]
                              + tokens(1000 + i, rng.randrange(1, 9)), SamplingParams())
                cached, n = kv.find_cached_prefix(req)
                req.num_computed_tokens = n
                if kv.can_allocate(req, req.num_tokens - n, cached):
                    kv.allocate(req, req.num_tokens - n, cached)
                    req.num_computed_tokens = req.num_tokens
                    kv.cache_computed_blocks(req)
                    running.append(req)
            log.publish()
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    router, cursor, snapshots = set(), -1, 0
    while True:
        finished = done.is_set()
        changes = log.changes(cursor)
        if changes.since < 0:
            router, snapshots = set(changes.stored), snapshots + 1
        else:
            router = (router | set(changes.stored)) - set(changes.removed)
        cursor = changes.cursor
        if finished:
            break
    thread.join()
    assert router == set(kv.allocator._by_hash) and cursor == log.cursor > 100
    assert snapshots >= 1
