"""The late-write hazard: a prefill engine's (P) write into blocks a decode engine (D)
reserved, whose transfer was dropped, must never land in a block D has handed to another
request. D fences such blocks (pd_cluster/kv_cache_quarantine.py) until P says its writes
drained (transfer/drain.py) or P's lease plus a margin passed.

The engines, transports and pumps are the real ones, in one process (NIXL over host memory,
UCX through ucxx); the test drives both engines' steps itself. P's writes go out late because
its pump is busy: a command blocks the pump until the test lets it go, so the layer writes
queue behind it, exactly as they do behind a slow pump.
"""
from __future__ import annotations

import threading

import pytest
import torch

from actors.kv_push import QUARANTINE_MARGIN_S, KVPusher
from actors.transport_pump import TransportPump
from tests.support.hf_reference import hf_greedy
from pd_cluster import EngineConfig, SamplingParams
from pd_cluster.engine import LLMEngine
from pd_cluster.kv_cache_quarantine import KVQuarantine, Release
from tests.support.tiny_models import make_tiny_model
from transfer.registry import make_transport
from tests.support.waiting import wait_until

BACKENDS = ["nixl", "ucx"]
BS = 16
PROMPT_A = list(range(5, 45))            # 3 blocks, written by P into D
PROMPT_B = list(range(100, 130))         # 2 blocks to start, 4 with its 24 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def hf_b(tiny):
    return hf_greedy(tiny, [PROMPT_B], GREEDY.max_tokens)[0]


class Pair:
    """P and D engines whose KV caches are linked by one backend, each transport owned by a
    pump; D's engine quarantines as the decode actor's does (kv_push.quarantine_late_writes),
    but here the test's thread is D's engine thread."""

    def __init__(self, model: str, backend: str, d_blocks: int, lease_s: float = 10.0):
        self.p = LLMEngine(EngineConfig(model=model, block_size=BS, num_kv_blocks=32))
        self.d = LLMEngine(EngineConfig(model=model, block_size=BS, num_kv_blocks=d_blocks))
        trs = []
        for engine in (self.p, self.d):
            tr = make_transport(backend, timeout_s=30.0, lease_s=lease_s)
            tr.register(engine.kv_cache, engine.kv_layout)
            trs.append(tr)
        p_tr, d_tr = trs
        self.d_name = p_tr.connect(d_tr.descriptor())
        d_tr.connect(p_tr.descriptor())
        self.p_pump, self.d_pump = TransportPump(p_tr, "p-pump"), TransportPump(d_tr, "d-pump")
        self.quarantine = self.d.kv.enable_quarantine(lease_s + QUARANTINE_MARGIN_S)
        self.d_pump.call(lambda tr: tr.on_drained(self.quarantine.drained)).result(10)
        self.pusher = KVPusher(self.p_pump, BS, torch.device("cpu"))
        self.gate = threading.Event()

    def hold_p_pump(self) -> None:
        """P's pump runs nothing more (its writes queue) until `gate` is set."""
        self.p_pump.call(lambda tr: self.gate.wait(60))

    def prefill_a(self) -> list[int]:
        """D reserves prompt A; P prefills it and queues its layer writes into D's blocks."""
        rid, blocks, cached = self.d.reserve(PROMPT_A, GREEDY, "A")
        assert cached == 0
        self.pusher.add("A", self.d_name, blocks, cached)
        self.p.add_request(PROMPT_A, ONE, "A", hold_kv=True)
        while self.p.has_unfinished():
            self.p.step(self.pusher)
        return blocks

    def run_b(self) -> tuple[list[int], list[int]]:
        """D computes prompt B itself to the end: (B's first blocks, its greedy tokens)."""
        self.d.add_request(PROMPT_B, GREEDY, "B")
        first_blocks, tokens = None, []
        while self.d.has_unfinished():
            for out in self.d.step():
                tokens = out.outputs[0].token_ids
            req = self.d.scheduler.requests.get("B")
            if first_blocks is None and req is not None and req.block_ids:
                first_blocks = list(req.block_ids)
        return first_blocks, tokens

    def close(self) -> None:
        self.gate.set()
        for pump in (self.p_pump, self.d_pump):
            pump.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    pytest.importorskip({"nixl": "nixl", "ucx": "ucxx"}[request.param])
    return request.param


def test_a_late_write_lands_in_quarantine_not_in_the_new_owner(tiny, hf_b, backend):
    """D drops A's reservation while every write of A is still to go; B needs A's blocks
    (D has 4: 3 fenced, 1 free, B's prompt needs 2) and waits. Then P's writes land, in A's fenced
    blocks; P learns of the abort and drains; DRAINED frees the blocks; B takes them and
    its greedy output equals HF's."""
    pair = Pair(tiny, backend, d_blocks=4)
    try:
        pair.hold_p_pump()
        a_blocks = pair.prefill_a()
        p_blocks = list(pair.p.scheduler.holding["A"].block_ids)
        pair.d.abort("A")                                   # e.g. its lease expired
        assert pair.quarantine.held_block_ids() == set(a_blocks)
        assert pair.d.kv.num_free_blocks == 4 - len(a_blocks)

        pair.d.add_request(PROMPT_B, GREEDY, "B")
        for _ in range(3):                                  # no room for B while A is fenced
            pair.d.step()
            assert not pair.d.scheduler.requests["B"].block_ids

        pair.pusher.abort("A")      # P hears of the abort: queued after A's writes
        pair.gate.set()             # P's pump goes on: the writes of A go out, late
        # They land in A's fenced blocks (nobody's now): D's bytes become P's.
        wait_until(lambda: torch.equal(pair.d.kv_cache[:, :, a_blocks],
                                       pair.p.kv_cache[:, :, p_blocks]), 10, 0.01,
                   what="A's late writes landed in its quarantined blocks")
        wait_until(lambda: pair.d.kv.num_free_blocks == 4, 10, 0.01,
                   what="DRAINED freed A's blocks")
        assert pair.quarantine.stats.drained == 1 and pair.quarantine.stats.expired == 0

        tokens, b_blocks = [], None
        while pair.d.has_unfinished():
            for out in pair.d.step():
                tokens = out.outputs[0].token_ids
            if b_blocks is None and pair.d.scheduler.requests["B"].block_ids:
                b_blocks = list(pair.d.scheduler.requests["B"].block_ids)
        assert set(b_blocks) & set(a_blocks), "B was meant to reuse A's blocks"
        assert tokens == hf_b
        assert pair.d.kv.num_free_blocks == 4                # no block leaked
        pair.p.release("A")
        assert pair.p.kv.num_free_blocks == 32
    finally:
        pair.close()


def test_without_the_quarantine_the_same_late_write_corrupts_the_new_owner(tiny, hf_b,
                                                                          backend):
    """The control: D frees A's blocks at once (as before the quarantine), B takes some of
    them, the late writes of A overwrite B's KV, and B's output departs from HF's."""
    pair = Pair(tiny, backend, d_blocks=4)
    pair.d.kv.quarantine = None
    try:
        pair.hold_p_pump()
        a_blocks = pair.prefill_a()
        p_blocks = list(pair.p.scheduler.holding["A"].block_ids)
        pair.d.abort("A")
        pair.d.add_request(PROMPT_B, GREEDY, "B")
        pair.d.step()                                       # B's prefill, in A's old blocks
        assert set(pair.d.scheduler.requests["B"].block_ids) & set(a_blocks)
        pair.pusher.abort("A")
        pair.gate.set()
        wait_until(lambda: torch.equal(pair.d.kv_cache[:, :, a_blocks],
                                       pair.p.kv_cache[:, :, p_blocks]), 10, 0.01,
                   what="A's late writes landed, over B's KV")
        tokens = []
        while pair.d.has_unfinished():
            for out in pair.d.step():
                tokens = out.outputs[0].token_ids
        assert tokens != hf_b
    finally:
        pair.close()


@pytest.mark.slow
def test_a_dead_writers_fence_ends_at_its_deadline(tiny, hf_b, backend):
    """P never drains (it died with its writes unsent): A's blocks stay fenced for the lease
    plus the margin, then B gets them; P's writes never go out."""
    lease = 0.5
    pair = Pair(tiny, backend, d_blocks=4, lease_s=lease)
    try:
        pair.hold_p_pump()
        a_blocks = pair.prefill_a()
        pair.d.abort("A")
        assert pair.quarantine.held_block_ids() == set(a_blocks)
        b_blocks, tokens = pair.run_b()                     # waits out the fence
        assert pair.quarantine.stats.expired == 1 and pair.quarantine.stats.drained == 0
        assert set(b_blocks) & set(a_blocks) and tokens == hf_b
        assert pair.d.kv.num_free_blocks == 4
        pair.pusher.dests.clear()   # P stays dead: its queued writes find nothing to send
    finally:
        pair.close()


def test_only_the_written_blocks_are_fenced(tiny, backend):
    """A reservation with a prefix-cache hit: P skips the hit, so only the blocks past it
    are fenced; the shared prefix blocks stay cached and in use by nobody."""
    pair = Pair(tiny, backend, d_blocks=16)
    try:
        pair.d.add_request(PROMPT_A, ONE, "warm")
        while pair.d.has_unfinished():
            pair.d.step()
        _, blocks, cached = pair.d.reserve(PROMPT_A[:32] + [300, 301, 302], GREEDY, "C")
        assert cached == 32 and len(blocks) == 3
        pair.d.abort("C")
        assert pair.quarantine.held_block_ids() == {blocks[2]}
        assert pair.d.kv.num_free_blocks == 15
    finally:
        pair.close()


def test_quarantine_ends_by_confirmation_or_deadline_and_remembers_an_early_one():
    from pd_cluster.block_allocator import Block

    q = KVQuarantine(window_s=0.2)
    q.hold("a", [Block(1), Block(2)])
    q.hold("b", [Block(3)])
    assert q.settle() == [] and q.held_block_ids() == {1, 2, 3}
    q.drained("a")
    assert [(k, why, [b.block_id for b in bs]) for k, why, bs in q.settle()] == \
        [("a", Release.DRAINED, [1, 2])]
    q.drained("c")                          # the writer drained before the hold
    assert q.settle() == []
    q.hold("c", [Block(4)])
    assert [(k, why) for k, why, _ in q.settle()] == [("c", Release.DRAINED)]
    ended = wait_until(q.settle, 5, 0.02)
    assert [(k, why) for k, why, _ in ended] == [("b", Release.EXPIRED)]
    assert (q.stats.held, q.stats.drained, q.stats.expired, q.stats.blocks) == (3, 2, 1, 0)
