"""KV caches made of head-window shards (tensor-parallel engines) exchanging blocks with real
transports (local, NIXL and UCX loopback, Ray mailboxes) in one process: between any two
shardings every destination shard's window gets exactly its heads, replicated heads come from
one source shard, untouched blocks stay zero; matching windows still move merged whole-block
runs; incompatible caches are refused at connect."""
from __future__ import annotations

from dataclasses import asdict, replace

import msgpack
import pytest
import torch

from tests.support.kv import tiny_layout
from transfer.base import LayoutMismatchError
from transfer.messages import KVDescriptor
from transfer.registry import make_transport
from transfer.runs import byte_runs, shard_copies
from transfer.shards import check_shards, head_sources
from transfer.state import Role
from tests.support.waiting import wait_until

BACKENDS = ["local", "nixl", "ucx", "ray"]
LAYERS, BLOCKS = 3, 12
SRC, DST = [1, 2, 3, 7], [5, 6, 0, 9]   # 1-2-3 → 5-6 merge; the rest do not
MOVED = range(1, 3)

# name → (total KV heads, prefill windows, decode windows); a window is (head_start, heads)
SHARDINGS = {
    "tp2->tp1": (4, [(0, 2), (2, 2)], [(0, 4)]),
    "tp1->tp2": (4, [(0, 4)], [(0, 2), (2, 2)]),
    "tp2->tp2": (4, [(0, 2), (2, 2)], [(0, 2), (2, 2)]),
    "1 head on 2 ranks->tp1": (1, [(0, 1), (0, 1)], [(0, 1)]),
    "1 head on 2 ranks->2 ranks": (1, [(0, 1), (0, 1)], [(0, 1), (0, 1)]),
}


def whole(total: int, **kw):
    # float32 so that every element of the reference is a distinct, exact number
    return tiny_layout(**{**dict(num_blocks=BLOCKS, num_layers=LAYERS, num_kv_heads=total,
                                 head_dim=8, dtype="float32"), **kw})


def reference(total: int) -> torch.Tensor:
    """The full-head KV cache P would hold unsharded: distinct non-zero values."""
    lay = whole(total)
    return torch.arange(1, lay.nbytes // 4 + 1, dtype=torch.float32).reshape(lay.shape)


def shards_of(full: torch.Tensor | None, total: int, windows, **kw):
    out = []
    for start, n in windows:
        lay = replace(whole(total, **kw), num_kv_heads=n, head_start=start, total_kv_heads=total)
        t = lay.allocate() if full is None else full[..., start:start + n, :].contiguous()
        out.append((t, lay))
    return out


def wait_all(*pairs) -> None:
    wait_until(lambda: all([tr.poll(t).finished for tr, t in pairs]), 20, 1e-3)
    for _, t in pairs:
        t.raise_if_failed()


def cases() -> list:
    """(backend, sharding, op): every one of the cross product, except over ray, whose
    transports start a mailbox actor each (more than a second a case on 2 cores): there each
    sharding once, the ops alternating, so that ray still writes and reads across shards."""
    out = []
    for backend in BACKENDS:
        for i, sharding in enumerate(SHARDINGS):
            ops = [("write", "read")[i % 2]] if backend == "ray" else ["write", "read"]
            out += [pytest.param(backend, sharding, op, id=f"{backend}-{sharding}-{op}")
                    for op in ops]
    return out


@pytest.fixture
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    elif request.param in ("nixl", "ucx"):
        pytest.importorskip({"nixl": "nixl", "ucx": "ucxx"}[request.param])
    return request.param


def connected(backend: str, p_shards, d_shards):
    p, d = make_transport(backend), make_transport(backend)
    p.register_shards(p_shards)
    d.register_shards(d_shards)
    p.connect(d.descriptor().encode())
    d.connect(p.descriptor().encode())
    return p, d


@pytest.mark.slow
@pytest.mark.parametrize("backend, sharding, op", cases(), indirect=["backend"])
def test_every_destination_shard_gets_exactly_its_heads(backend, sharding, op) -> None:
    total, p_windows, d_windows = SHARDINGS[sharding]
    ref = reference(total)
    p_shards = shards_of(ref, total, p_windows)
    for t, lay in p_shards[1:]:
        if lay.head_start == p_shards[0][1].head_start:
            t.fill_(-1.0)   # a replica: never read (the first shard holding a head feeds it)
    d_shards = shards_of(None, total, d_windows)
    p, d = connected(backend, p_shards, d_shards)
    try:
        if op == "write":
            t = p.write(d.name, SRC, DST, MOVED, transfer_id="w")
            wait_all((p, t), (d, d.expect(p.name, "w")))
        else:                                     # the decode side pulls
            t = d.read(p.name, DST, SRC, MOVED, transfer_id="r")
            wait_all((d, t), (p, p.expect(d.name, "r")))
        for got, lay in d_shards:
            want = torch.zeros(lay.shape)
            heads = slice(lay.head_start, lay.head_start + lay.num_kv_heads)
            moved = slice(MOVED.start, MOVED.stop)
            want[moved, :, DST] = ref[moved, :, SRC][..., heads, :]
            assert torch.equal(got, want), (sharding, lay.heads)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("field,value", [("head_dim", 16), ("total_kv_heads", 8)])
def test_incompatible_shards_are_refused_at_connect_naming_the_field(field, value) -> None:
    p = make_transport("local")
    p.register_shards(shards_of(reference(4), 4, [(0, 2), (2, 2)]))
    d = make_transport("local")
    if field == "head_dim":
        d.register_shards(shards_of(None, 4, [(0, 4)], head_dim=16))
    else:
        d.register_shards(shards_of(None, 8, [(0, 4), (4, 4)]))
    with pytest.raises(LayoutMismatchError, match=f"{field}: "):
        p.connect(d.descriptor().encode())


def test_a_cache_must_hold_every_head_in_same_sized_shards() -> None:
    tr = make_transport("local")
    with pytest.raises(ValueError, match=r"KV heads \[2, 3\] of 4 are in no shard"):
        tr.register_shards(shards_of(None, 4, [(0, 2)]))
    a, b = shards_of(None, 4, [(0, 2), (2, 2)])
    small = replace(b[1], num_blocks=4)
    assert "4 blocks" in check_shards([a[1], small])


def test_the_descriptor_carries_every_shard_and_decodes_old_ones() -> None:
    tr = make_transport("local")
    shards = shards_of(None, 4, [(0, 2), (2, 2)])
    tr.register_shards(shards)
    desc = KVDescriptor.decode(tr.descriptor().encode())
    assert [s.layout for s in desc.shards] == [lay for _, lay in shards]
    assert [s.base_addr for s in desc.shards] == [t.data_ptr() for t, _ in shards]
    assert desc.layout == whole(4) and tr.layout == whole(4)
    # as encoded before shards: one tensor's fields inline, a layout without head fields
    old_layout = {k: v for k, v in asdict(whole(4)).items()
                  if k not in ("head_start", "total_kv_heads")}
    old = msgpack.packb({"backend": "local", "agent": "x", "layout": old_layout,
                         "base_addr": 64, "device_id": 0, "on_gpu": False, "address": b""})
    (shard,) = KVDescriptor.decode(old).shards
    assert (shard.layout, shard.base_addr) == (whole(4), 64)


def test_matching_windows_keep_merged_whole_block_runs() -> None:
    """tp=2 → tp=2: per shard, the runs of an unsharded cache (1-2-3 → 5-6-... merge), offset
    by the shard's place; differing windows: one run per token and head window."""
    lays = [lay for _, lay in shards_of(None, 4, [(0, 2), (2, 2)])]
    same = shard_copies(lays, lays, head_sources(lays, lays), MOVED, SRC, DST)
    single = byte_runs(lays[0], lays[0], MOVED, SRC, DST)
    assert len(single) == 3 * 2 * len(MOVED)          # 3 runs per (layer, K|V)
    assert len(same) == 2 * len(single)
    assert [tuple(r) for r in same[:len(single)].tolist()] == single
    full = [whole(4)]
    split = shard_copies(lays, full, head_sources(lays, full), MOVED, SRC, DST)
    bs, hb = full[0].block_size, full[0].head_bytes
    assert len(split) == 2 * len(MOVED) * len(SRC) * bs * 2 and set(split[:, 2]) == {2 * hb}


def test_nixl_posts_merged_runs_between_matching_shards() -> None:
    pytest.importorskip("transfer.nixl_transport")   # either nixl install
    total, windows, _ = SHARDINGS["tp2->tp2"]
    p, d = connected("nixl", shards_of(reference(total), total, windows),
                     shards_of(None, total, windows))
    try:
        t = p.write(d.name, SRC, DST, MOVED, transfer_id="m")
        wait_all((p, t), (d, d.expect(p.name, "m")))
        assert (p.posted, p.posted_runs) == (1, 2 * 2 * len(MOVED) * 3)
        plan = p._plan(Role.WRITE, p.peers[d.name], MOVED, SRC, DST)
        assert plan[0].ndim == 1    # prepared block indices, not explicit descriptors
    finally:
        p.close()
        d.close()
