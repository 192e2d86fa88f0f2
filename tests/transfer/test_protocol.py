"""The transport protocol in one process: block-run merging, typed messages, byte-exact
write/read, layout checks, aborts, drains, timeouts and leases (local backend, and NIXL and
UCX loopback)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support import REPO as ROOT
from tests.support.kv import blocks, model_kv, paged_kv, tiny_layout
from transfer import registry
from transfer.base import LayoutMismatchError, TransferError, TransferState
from transfer.drain import in_group, member_id
from transfer.messages import KVDescriptor, KVShard, Message, MessageError, MsgKind
from transfer.registry import make_transport
from transfer.runs import block_indices, byte_runs
from tests.support.waiting import wait_until


BACKENDS = ["local", "nixl", "ucx"]


def test_runs_merge_blocks_contiguous_on_both_sides() -> None:
    layout = tiny_layout(num_blocks=8)
    nb = layout.block_bytes
    layer_0_k = byte_runs(layout, layout, range(0, 1), [4, 5, 6, 1, 2], [0, 1, 2, 3, 7])[:3]
    assert layer_0_k == [(4 * nb, 0, 3 * nb), (1 * nb, 3 * nb, nb), (2 * nb, 7 * nb, nb)]
    copies = byte_runs(layout, tiny_layout(num_blocks=16), range(1, 2), [2, 3], [5, 6])
    # layer 1 K then V, one run each; offsets count in each KV cache's own block count
    assert copies == [((2 * 8 + 2) * nb, (2 * 16 + 5) * nb, 2 * nb),
                      ((3 * 8 + 2) * nb, (3 * 16 + 5) * nb, 2 * nb)]
    with pytest.raises(ValueError, match="out of range"):
        byte_runs(layout, layout, range(2), [8], [0])


def test_block_indices_name_the_same_bytes_as_the_runs() -> None:
    src, dst = tiny_layout(num_blocks=8), tiny_layout(num_blocks=16)
    s_ids, d_ids = [2, 3, 7, 0], [5, 6, 1, 9]
    local, remote = block_indices(src, dst, range(0, 2), s_ids, d_ids)
    nb = src.block_bytes
    expanded = [(s + i * nb, d + i * nb) for s, d, n in byte_runs(src, dst, range(0, 2), s_ids,
                                                                  d_ids) for i in range(n // nb)]
    assert [(int(a) * nb, int(b) * nb) for a, b in zip(local, remote)] == expanded
    with pytest.raises(ValueError, match="out of range"):
        block_indices(src, dst, range(1), [-1], [0])


def test_an_empty_write_completes_and_tells_the_target(pair) -> None:
    a, b = pair
    t = a.write(b.name, [], [], transfer_id="empty")
    target = b.expect(a.name, "empty")
    wait_all((a, t), (b, target))
    a.release(t)
    b.release(target)


def test_messages_round_trip_and_reject_junk() -> None:
    msg = Message(MsgKind.DATA, "t1", "a", runs=((0, 64), (128, 64)), tag=7)
    assert Message.decode(msg.encode()) == msg
    desc = KVDescriptor("nixl", "a", (KVShard(tiny_layout(), 4096, 0),), False, b"\x00md")
    assert KVDescriptor.decode(desc.encode()) == desc
    for junk in (b"\x93\x01\x02\x03", b"not msgpack \xc1", Message(MsgKind.DONE, "t", "a")
                 .encode().replace(b"done", b"boom")):
        with pytest.raises(MessageError):
            Message.decode(junk)


def test_unknown_or_missing_backend_says_what_to_do(monkeypatch) -> None:
    with pytest.raises(ValueError, match="choose one of"):
        make_transport("carrier-pigeon")
    monkeypatch.setitem(registry._BACKENDS, "nixl", ("no_such_nixl_module", "X", "pip install nixl"))
    with pytest.raises(ImportError, match="install it with: pip install nixl"):
        make_transport("nixl")


@pytest.mark.slow
def test_nixl_runs_from_the_cuda_12_build_alone_as_the_transfer_extra_installs_it() -> None:
    """`transfer` installs nixl-cu12 without the `nixl` meta-package: host-memory NIXL still
    moves blocks (an agent made and its memory registered)."""
    pytest.importorskip("nixl_cu12")
    code = ("import sys; sys.modules['nixl'] = None\n"
            "import torch\n"
            "from transfer import nixl_transport as t\n"
            "agent = t.nixl_agent('cu12-alone', t.nixl_agent_config(backends=['UCX']))\n"
            "agent.register_memory(torch.zeros(1024, dtype=torch.uint8))\n"
            "print(t._api.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "nixl_cu12._api"


def test_nixl_ucx_params_default_to_four_workers_for_gpu_memory_only(monkeypatch) -> None:
    nixl_transport = pytest.importorskip("transfer.nixl_transport")
    env, params = nixl_transport.UCX_PARAMS_ENV, nixl_transport.ucx_params_from_env
    monkeypatch.delenv(env, raising=False)
    assert params(on_gpu=True) == {"num_workers": "4"} and params(on_gpu=False) == {}
    monkeypatch.setenv(env, "num_workers=1, num_threads=2")    # the operator's word wins
    assert params(on_gpu=True) == params(on_gpu=False) == {"num_workers": "1", "num_threads": "2"}
    monkeypatch.setenv(env, "")                                # set but empty: UCX's defaults
    assert params(on_gpu=True) == {}
    monkeypatch.setenv(env, "num_workers")
    with pytest.raises(ValueError, match="expected name=value"):
        params(on_gpu=True)


def _pair(backend: str, layout_b=None, **kwargs):
    layout = tiny_layout()
    a, b = make_transport(backend, **kwargs), make_transport(backend, **kwargs)
    kv = model_kv(layout, 22, seed=3)
    a.register(paged_kv(layout, kv, [3, 4, 5, 6, 10, 11]), layout)
    layout_b = layout_b or tiny_layout(num_blocks=24)
    b.register(layout_b.allocate(), layout_b)
    return a, b


def wait_all(*pairs) -> None:
    """Progress every (transport, transfer) until all end: two-sided backends (ray, ucx) need
    the target to progress too, as its owner's loop does in an engine."""
    try:
        wait_until(lambda: all([tr.poll(t).finished for tr, t in pairs]), 10, 1e-3)
    except TimeoutError:
        raise AssertionError([t.state for _, t in pairs]) from None
    for _, t in pairs:
        t.raise_if_failed()


@pytest.fixture(params=BACKENDS)
def pair(request):
    a, b = _pair(request.param)
    a.connect(b.descriptor().encode())
    b.connect(a.descriptor())
    yield a, b
    a.close()
    b.close()


def test_write_then_read_are_byte_exact_and_notify_the_target(pair) -> None:
    a, b = pair
    src, dst = [3, 4, 5, 6, 10, 11], [0, 1, 2, 7, 8, 20]
    target = b.expect(a.name, "w1")
    t = a.write(b.name, src, dst, transfer_id="w1")
    wait_all((a, t), (b, target))
    assert torch.equal(blocks(b.kv, dst), blocks(a.kv, src))
    if hasattr(a, "posted_runs"):   # nixl counts what it posts: 3-4-5 -> 0-1-2 merge, the rest
        assert (a.posted, a.posted_runs) == (1, 4 * 2 * a.layout.num_layers)   # do not
    a.kv[:, :, src] = 0
    r = a.read(b.name, src[:3], dst[:3], layers=range(1, 2))
    served = b.expect(a.name, r.id)
    wait_all((a, r), (b, served))
    assert torch.equal(blocks(a.kv, src[:3], range(1, 2)), blocks(b.kv, dst[:3], range(1, 2)))
    assert torch.count_nonzero(blocks(a.kv, src[:3], range(0, 1))) == 0
    for x in (t, r):
        a.release(x)
    for x in (target, served):
        b.release(x)
    assert a.in_flight() == b.in_flight() == 0


@pytest.mark.parametrize("field,value", [("dtype", "float16"), ("head_dim", 32),
                                         ("block_size", 8), ("model", "other")])
def test_layout_mismatch_is_refused_naming_the_difference(field, value) -> None:
    a, b = _pair("local", layout_b=tiny_layout(**{field: value}))
    with pytest.raises(LayoutMismatchError, match=f"{field}: "):
        a.connect(b.descriptor())


def test_abort_ends_both_sides(pair) -> None:
    a, b = pair
    target = b.expect(a.name, "x1")
    b.abort(target, "request cancelled")
    t = a.write(b.name, [3], [0], transfer_id="x1")

    def settled() -> bool:
        b.progress()
        return a.poll(t) is not TransferState.IN_FLIGHT
    wait_until(settled, 5, 0)
    # the initiator learns of the abort whichever came first, its DONE or the peer's ABORT
    assert target.state is TransferState.ABORTED
    assert t.state in (TransferState.ABORTED, TransferState.DONE)
    b.release(target)
    a.release(t)


def test_a_drained_group_reaches_the_receiver_after_its_writes(pair) -> None:
    """The sender abandons a group of writes (posted, maybe still moving): they end ABORTED
    at once, but the receiver hears DRAINED only once none of them can land, and the sender
    holds nothing afterwards."""
    a, b = pair
    got: list[str] = []
    b.on_drained(got.append)
    ts = [a.write(b.name, [3, 4], [0, 1], transfer_id=member_id("r1", 0, 0)),
          a.write(b.name, [5], [2], transfer_id=member_id("r1", 0, 1))]
    a.drain(b.name, "r1", ts)
    assert all(t.state.finished for t in ts)

    def reported() -> list[str]:
        a.progress()
        b.progress()
        return got
    wait_until(reported, 10, 1e-3)
    assert got == ["r1"] and a.in_flight() == 0 and not a._outgoing
    # The writes were not stopped, only waited for: their bytes are all there.
    assert torch.equal(blocks(b.kv, [0, 1, 2]), blocks(a.kv, [3, 4, 5]))
    assert in_group(ts[0].id, "r1") and not in_group(ts[0].id, "r")


def test_lease_expires_when_the_peer_stops_renewing() -> None:
    a, b = _pair("local", lease_s=0.2)
    b.connect(a.descriptor())
    target = b.expect(a.name, "quiet")   # a never writes nor renews: as if it had died
    wait_until(lambda: b.poll(target).finished, 5, 0.02)
    assert target.state is TransferState.EXPIRED
    with pytest.raises(TransferError, match="stopped renewing its lease"):
        target.raise_if_failed()


def test_every_wait_has_a_deadline() -> None:
    a, b = _pair("local", timeout_s=0.2, lease_s=60)
    b.connect(a.descriptor())
    target = b.expect(a.name, "never")
    with pytest.raises(TransferError, match="timed_out"):
        b.wait(target)
