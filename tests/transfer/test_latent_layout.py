"""A latent KV cache (multi-head latent attention: one entry of L + R values per token and
layer instead of K and V, pd_cluster/kv_layout.py `latent`): its layout's shape and sizes,
the byte runs that move its blocks, and real transports (local, NIXL loopback, Ray
mailboxes) moving it between engines of any tensor-parallel degrees, where every rank holds
the whole latent and a receiver takes one sender's copy."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pd_cluster.kv_layout import KVLayout
from tests.support.waiting import wait_until
from transfer.base import LayoutMismatchError
from transfer.registry import make_transport
from transfer.runs import byte_runs
from transfer.shards import head_sources

LAYERS, BLOCKS, WIDTH = 3, 10, 40          # WIDTH: kv_lora_rank 32 + qk_rope_head_dim 8
SRC, DST = [1, 2, 3, 7], [5, 6, 7, 0]      # 1-2-3 -> 5-6-7 merge into one run


def latent_layout(**kw) -> KVLayout:
    return KVLayout(**{**dict(model="tiny-deepseek", dtype="float32", num_layers=LAYERS,
                              num_blocks=BLOCKS, block_size=4, num_kv_heads=1, head_dim=WIDTH,
                              latent=True), **kw})


def test_a_latent_layout_has_one_part_per_layer():
    lay = latent_layout()
    assert lay.shape == (LAYERS, 1, BLOCKS, 4, 1, WIDTH)
    assert lay.block_bytes == 4 * WIDTH * 4
    assert lay.bytes_per_block_id == LAYERS * lay.block_bytes     # no V region
    assert lay.nbytes == BLOCKS * lay.bytes_per_block_id == lay.allocate().numel() * 4
    kv = replace(lay, latent=False)
    assert kv.nbytes == 2 * lay.nbytes
    assert "latent: True != False" in lay.mismatch(kv)
    with pytest.raises(ValueError, match="one head"):
        latent_layout(num_kv_heads=2)


def test_byte_runs_step_over_layers_not_k_and_v():
    lay = latent_layout()
    runs = byte_runs(lay, lay, range(1, 3), SRC, DST)
    bb = lay.block_bytes
    # Per layer one merged run (3 blocks) and one single block; layer l starts at l * B blocks.
    assert runs == [((l * BLOCKS + s) * bb, (l * BLOCKS + d) * bb, n * bb)
                    for l in (1, 2) for s, d, n in ((1, 5, 3), (7, 0, 1))]


def test_replicated_latent_shards_read_one_senders_copy():
    ranks = lambda n: [replace(latent_layout(), total_kv_heads=1) for _ in range(n)]  # noqa: E731
    # P at tp=2 -> D at tp=4: every D rank's shard is fed from P's rank 0 alone.
    assert [(g.src, g.dst) for g in head_sources(ranks(2), ranks(4))] == \
        [(0, 0), (0, 1), (0, 2), (0, 3)]


def reference() -> torch.Tensor:
    lay = latent_layout()
    return torch.arange(1, lay.nbytes // 4 + 1, dtype=torch.float32).reshape(lay.shape)


@pytest.fixture(params=["local", "nixl", "ray"])
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    elif request.param == "nixl":
        pytest.importorskip("nixl")
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_transports_move_latent_blocks_between_any_degrees(backend, p_tp, d_tp):
    full = reference()
    # P's other ranks hold the same latent; -1 here proves that no receiver reads them.
    p_shards = [(full.clone() if r == 0 else torch.full_like(full, -1.0), latent_layout())
                for r in range(p_tp)]
    d_shards = [(latent_layout().allocate(), latent_layout()) for _ in range(d_tp)]
    p, d = make_transport(backend), make_transport(backend)
    try:
        p.register_shards(p_shards)
        d.register_shards(d_shards)
        p.connect(d.descriptor().encode())
        d.connect(p.descriptor().encode())
        t = p.write(d.name, SRC, DST, layers=range(LAYERS))
        target = d.expect(p.name, t.id)
        # Both sides progress on every poll (a list, not `and`: the target acknowledges).
        wait_until(lambda: all([p.poll(t).finished, d.poll(target).finished]), 20, 1e-3)
        t.raise_if_failed()
        target.raise_if_failed()
        for kv, _ in d_shards:          # every D rank holds the whole latent of the blocks
            for s, dst in zip(SRC, DST):
                assert torch.equal(kv[:, :, dst], full[:, :, s])
            untouched = [b for b in range(BLOCKS) if b not in DST]
            assert not kv[:, :, untouched].any()
    finally:
        p.close()
        d.close()


def test_a_latent_cache_and_a_kv_cache_are_refused_at_connect():
    p, d = make_transport("local"), make_transport("local")
    kv_layout = replace(latent_layout(), latent=False)
    try:
        p.register(latent_layout().allocate(), latent_layout())
        d.register(kv_layout.allocate(), kv_layout)
        with pytest.raises(LayoutMismatchError, match="latent"):
            p.connect(d.descriptor())
    finally:
        p.close()
        d.close()
