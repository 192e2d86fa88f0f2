"""KV blocks between two processes (Ray actors) with each CPU-capable backend: byte-exact
writes and reads, a refused layout, and a killed peer / abort / expired lease that each end
in a clear error with every block back in its free list on both sides."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from tests.support.kv import FreeList, blocks, model_kv, paged_kv, tiny_layout
from transfer.base import LayoutMismatchError, TransferError
from transfer.messages import KVDescriptor
from tests.support.waiting import wait_until

ray = pytest.importorskip("ray")

BACKENDS = ["nixl", "ucx", "ray"]
# Short, so that the killed sender's lease expires soon; not 1 s: renewals come every lease / 3,
# and on a loaded 2-core machine a Ray actor's renewal came more than 1 s late (the ray push
# of test_layer_by_layer_push_and_a_pull_are_byte_exact aborted: "stopped renewing its lease").
FAST = dict(timeout_s=5.0, lease_s=3.0)


class Engine:
    """The simulated engine side: a paged KV cache, its free list, and one transport."""

    def __init__(self, backend: str, layout, kv_tokens: torch.Tensor | None = None, **kw):
        from transfer.registry import make_transport

        self.alloc = FreeList(layout.num_blocks)
        self.prompt = self.alloc.allocate(0 if kv_tokens is None else
                                          -(-kv_tokens.shape[2] // layout.block_size))
        self.kv = paged_kv(layout, kv_tokens, self.prompt) if kv_tokens is not None \
            else layout.allocate()
        self.t = make_transport(backend, **kw)
        self.t.register(self.kv, layout)
        self.transfers, self.held = {}, {}

    def descriptor(self) -> bytes:
        return self.t.descriptor().encode()

    def connect(self, desc: bytes) -> str:
        return self.t.connect(desc)

    def reserve(self, peer: str, n: int, tid: str, lease_s: float | None = None) -> list[int]:
        """Decode side: preallocate blocks for a peer's write and hold them under its lease."""
        self.held[tid] = self.alloc.allocate(n)
        self.transfers[tid] = self.t.expect(peer, tid, lease_s)
        return self.held[tid]

    def lend(self, peer: str, tid: str) -> None:
        """Source side of a peer's read: our blocks stay put until it completes or expires."""
        self.transfers[tid] = self.t.expect(peer, tid)

    def push(self, peer: str, dst: list[int], tid: str, layers: range | None = None) -> None:
        self.transfers[tid] = self.t.write(peer, self.prompt, dst, layers, transfer_id=tid)

    def pull(self, peer: str, src: list[int], tid: str) -> list[int]:
        self.held[tid] = self.alloc.allocate(len(src))
        self.transfers[tid] = self.t.read(peer, self.held[tid], src, transfer_id=tid)
        return self.held[tid]

    def abort(self, tid: str) -> None:
        self.t.abort(self.transfers[tid], "request cancelled")

    def finish(self, tid: str) -> tuple[str, str]:
        """Wait for a transfer; free what was held for it unless it succeeded."""
        t = self.transfers.pop(tid)
        try:
            self.t.wait(t)
        except TransferError as e:
            self.alloc.free(self.held.pop(tid, []))
            return t.state.value, str(e)
        finally:
            self.t.release(t)
        return t.state.value, ""

    def blocks(self, ids: list[int]) -> torch.Tensor:
        return blocks(self.kv, ids)

    def free(self, ids: list[int]) -> None:
        self.alloc.free(ids)

    def leaks(self) -> dict:
        """Blocks not in the free list beyond the prompt's own, and transfers still tracked."""
        return dict(blocks=self.alloc.num_blocks - len(self.prompt) - self.alloc.num_free,
                    in_flight=self.t.in_flight())


RemoteEngine = ray.remote(num_cpus=0)(Engine)
LAYOUT = tiny_layout()


@pytest.fixture(scope="module")
def kv() -> torch.Tensor:
    return model_kv(LAYOUT, 22, seed=7)  # 6 blocks of 4 tokens, the last one partial


def spawn(backend: str, layout=LAYOUT, kv=None, **kw):
    return RemoteEngine.remote(backend, layout, kv, **{**FAST, **kw})


def link(a, b) -> tuple[str, str]:
    """Connect both ways (control messages flow back too); returns (a's name, b's name)."""
    b_name = ray.get(a.connect.remote(ray.get(b.descriptor.remote())))
    a_name = ray.get(b.connect.remote(ray.get(a.descriptor.remote())))
    return a_name, b_name


@pytest.fixture(scope="module", params=BACKENDS)
def engines(request, ray_cluster, kv):
    p, d = spawn(request.param, kv=kv), spawn(request.param)
    names = link(p, d)
    yield request.param, p, d, names
    assert ray.get(p.leaks.remote()) == ray.get(d.leaks.remote()) == dict(blocks=0, in_flight=0)
    for a in (p, d):
        ray.kill(a)


def test_layer_by_layer_push_and_a_pull_are_byte_exact(engines, kv) -> None:
    _, p, d, (p_name, d_name) = engines
    want = paged_kv(LAYOUT, kv, list(range(6)))[:, :, :6]
    dst = ray.get(d.reserve.remote(p_name, 6, "req1/0"))
    for layer in range(LAYOUT.num_layers):  # as prefill pushes each layer once it is computed
        tid = f"req1/{layer}"
        if layer:
            ray.get(d.lend.remote(p_name, tid))
        ray.get(p.push.remote(d_name, dst, tid, range(layer, layer + 1)))
        assert ray.get([p.finish.remote(tid), d.finish.remote(tid)]) == [("done", "")] * 2
    assert torch.equal(ray.get(d.blocks.remote(dst)), want)
    ray.get(d.lend.remote(p_name, "req2"))  # two-sided backends: the source serves the read
    got = ray.get(p.pull.remote(d_name, dst[:3], "req2"))
    assert ray.get([p.finish.remote("req2"), d.finish.remote("req2")]) == [("done", "")] * 2
    assert torch.equal(ray.get(p.blocks.remote(got)), want[:, :, :3])
    ray.get([p.free.remote(got), d.free.remote(dst)])


def test_incompatible_layout_is_refused_across_processes(engines) -> None:
    _, p, d, _ = engines
    theirs = KVDescriptor.decode(ray.get(d.descriptor.remote()))
    shard = theirs.shards[0]
    other = replace(theirs, agent="other",
                    shards=(replace(shard, layout=replace(shard.layout, head_dim=32)),))
    with pytest.raises(LayoutMismatchError, match="head_dim: 16 != 32"):
        ray.get(p.connect.remote(other.encode()))


def test_abort_by_the_receiver_ends_both_sides(engines) -> None:
    _, p, d, (p_name, d_name) = engines
    dst = ray.get(d.reserve.remote(p_name, 6, "req3"))
    ray.get(d.abort.remote("req3"))
    ray.get(p.push.remote(d_name, dst, "req3"))
    (ps, perr), (ds, derr) = ray.get([p.finish.remote("req3"), d.finish.remote("req3")])
    assert (ps, ds) == ("aborted", "aborted") and "request cancelled" in perr + derr


def test_expired_lease_frees_the_receivers_blocks(engines) -> None:
    _, p, d, (p_name, _) = engines
    ray.get(d.reserve.remote(p_name, 6, "req4", 0.3))  # the sender never starts
    state, err = ray.get(d.finish.remote("req4"))
    assert state == "expired" and "stopped renewing its lease" in err


# Over nixl alone: a killed sender stops renewing, and the receiver's lease expiry is the
# transports' common logic (transfer/base.py), which test_expired_lease_frees_the_receivers_
# blocks asserts over each backend. (nixl is index 0 of BACKENDS, as it must be here: pytest
# groups the tests by the index of the module fixture's parameter.)
@pytest.mark.parametrize("engines", ["nixl"], indirect=True)
def test_a_killed_sender_ends_in_lease_expiry(engines, kv) -> None:
    backend, _, d, _ = engines
    doomed = spawn(backend, kv=kv)
    doomed_name, d_name = link(doomed, d)
    ray.get(d.reserve.remote(doomed_name, 6, "req5"))
    ray.kill(doomed)
    state, err = ray.get(d.finish.remote("req5"))
    assert state == "expired" and doomed_name in err


def test_a_killed_receiver_fails_the_sender_cleanly(engines) -> None:
    backend, p, _, _ = engines
    doomed = spawn(backend)
    p_name, doomed_name = link(p, doomed)
    ray.get(doomed.reserve.remote(p_name, 6, "req6"))
    pid = ray.get(doomed.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(doomed)
    wait_until(lambda: not process_exists(pid), 10, what="the killed receiver's process gone")
    ray.get(p.push.remote(doomed_name, list(range(6)), "req6"))
    state, err = ray.get(p.finish.remote("req6"))
    assert state in ("failed", "timed_out") and doomed_name in err


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_ray_mailbox_releases_each_senders_messages_in_the_order_sent(ray_cluster) -> None:
    from transfer.ray_transport import _Mailbox

    box = _Mailbox.remote()
    # a's second message arrives before its first; b's come in order and are not held back
    ray.get([box.deliver.remote("a", 1, b"a1", []), box.deliver.remote("b", 0, b"b0", [])])
    assert [m for m, _ in ray.get(box.drain.remote(0.0))] == [b"b0"]
    ray.get(box.deliver.remote("a", 0, b"a0", []))
    assert [m for m, _ in ray.get(box.drain.remote(0.0))] == [b"a0", b"a1"]
    # an open drain answers at the first delivery, long before its wait runs out
    waiting = box.drain.remote(60.0)
    ray.get(box.deliver.remote("b", 1, b"b1", []))
    assert [m for m, _ in ray.get(waiting, timeout=10)] == [b"b1"]
    ray.kill(box)
