"""Paged decode and prefill attention kernels against the fp32 torch reference.

Without a GPU they run under TRITON_INTERPRET=1 on CPU in fp32 (the interpreter's tl.dot is
wrong on bf16), on tiny shapes. With a GPU, the same cases run in bf16, plus real shapes.
bf16 tolerance: P is rounded to bf16 before the P @ V product and the output is bf16, so
|out - ref| stays within about 1e-2 for unit-variance V; we allow atol = rtol = 2e-2.
"""
from tests.support.attention import DEVICE, DTYPE, INTERPRETED, paged_kv

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.decode_attention import (_block_n, choose_num_splits,  # noqa: E402
                                      decode_attention, one_warp)
from pd_cluster.cuda_graphs import context_caps  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from kernels.reference import decode_attention_ref, paged_attention_ref  # noqa: E402

TOL = 1e-4 if INTERPRETED else 2e-2
# Real shapes need a CUDA GPU: those tests are marked gpu (skipped without one: conftest.py).


def check_decode(seq_lens, block_size, num_heads, num_kv_heads, head_dim, **knobs):
    k_cache, v_cache, table = paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = decode_attention(q, k_cache, v_cache, table, lens, scale, max(seq_lens), **knobs)
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)


def check_prefill(cached_and_new, block_size, num_heads, num_kv_heads, head_dim, **knobs):
    seq_lens = [c + n for c, n in cached_and_new]
    k_cache, v_cache, table = paged_kv(seq_lens, block_size, num_kv_heads, head_dim)
    q_lens = [n for _, n in cached_and_new]
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = prefill_attention(q, k_cache, v_cache, table, lens, starts, max(q_lens), scale,
                            **knobs)
    ref = paged_attention_ref(q, k_cache, v_cache, table, lens, starts, scale)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)


# Contexts 1..100 are not multiples of the block size; block_n against block_size covers a
# tile inside one block, a tile equal to it and tiles spanning 2 and 4 blocks.
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,block_size,num_heads,num_kv_heads,block_n,num_splits", [
    (64, 16, 8, 2, 16, 3),     # GQA 4, several tiles per split
    (128, 32, 4, 4, 16, 2),    # MHA, tile inside a block
    (64, 16, 8, 1, 32, 8),     # MQA; short sequences leave trailing splits empty
    (128, 16, 4, 2, 64, None),  # launcher picks the split count
    (64, 16, 8, 2, 32, 1),     # one split: stage 1 writes the output, no stage 2
])
@pytest.mark.parametrize("transposed", [False, True])   # heads as the dots' M or N
def test_decode_attention_matches_reference(head_dim, block_size, num_heads, num_kv_heads,
                                            block_n, num_splits, transposed):
    check_decode([1, 37, 100, 70], block_size, num_heads, num_kv_heads, head_dim,
                 block_n=block_n, num_splits=num_splits, transposed=transposed)


# Scores that climb along the context (slope > 0: the running max grows by more than the
# kernel's lazy-rescale threshold within a tile, or only across several) or fall (slope < 0:
# the first tile's max stands to the end).
# An fp8 cache also widens p to float16 for P @ V, which the threshold keeps finite.
@pytest.mark.slow
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("slope", [0.25, 1.0, -0.5])
def test_decode_attention_follows_a_max_that_moves_along_the_context(slope, fp8, transposed):
    seq_lens, block_size, head_dim = [100, 61], 16, 64
    k_cache, v_cache, table = paged_kv(seq_lens, block_size, 2, head_dim)
    q = torch.zeros(len(seq_lens), 8, head_dim, dtype=DTYPE, device=DEVICE)
    q[..., 0] = 8.0
    for i, n in enumerate(seq_lens):
        for pos in range(n):
            block, slot = table[i, pos // block_size], pos % block_size
            k_cache[block, slot, :, 0] = slope * pos      # q . k = 8 * slope * pos
    kv_scale = None
    if fp8:
        kv_scale = torch.stack([k_cache.abs().max(), v_cache.abs().max()]).float() / 448
        k_cache = (k_cache / kv_scale[0]).to(torch.float8_e4m3fn)
        v_cache = (v_cache / kv_scale[1]).to(torch.float8_e4m3fn)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    for num_splits in (1, 2):
        out = decode_attention(q, k_cache, v_cache, table, lens, scale, max(seq_lens),
                               block_n=16, num_splits=num_splits, kv_scale=kv_scale,
                               transposed=transposed)
        ref = decode_attention_ref(q, k_cache, v_cache, table, lens, scale, kv_scale)
        tol = 1e-3 if fp8 and INTERPRETED else TOL     # p in float16 (tests/kernels/test_fp8_kv.py)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_num_splits_fill_the_gpu_but_stay_long_enough():
    # batch x 8 KV heads on 132 SMs: about 462 programs wanted, chunks of >= 256 tokens.
    assert choose_num_splits(seq_heads=64 * 8, max_seq_len=4096, num_sms=132) == 1
    assert choose_num_splits(seq_heads=16 * 8, max_seq_len=8192, num_sms=132) == 4
    assert choose_num_splits(seq_heads=16 * 8, max_seq_len=300, num_sms=132) == 2
    assert choose_num_splits(seq_heads=4 * 8, max_seq_len=32768, num_sms=132) == 15
    assert choose_num_splits(seq_heads=1 * 8, max_seq_len=32768, num_sms=132) == 58


def test_fp8_decode_takes_one_warp_programs_for_many_heads_or_long_contexts():
    assert one_warp(head_dim=128, fp8=True, seq_heads=128 * 8, max_seq_len=128)
    assert one_warp(head_dim=128, fp8=True, seq_heads=16 * 8, max_seq_len=4096)
    assert not one_warp(head_dim=128, fp8=True, seq_heads=64 * 8, max_seq_len=1024)
    assert not one_warp(head_dim=128, fp8=True, seq_heads=8 * 8, max_seq_len=4096)
    assert not one_warp(head_dim=128, fp8=False, seq_heads=256 * 8, max_seq_len=4096)
    assert not one_warp(head_dim=256, fp8=True, seq_heads=256 * 8, max_seq_len=4096)
    # one-warp tiles: 32 tokens at every batch (two in flight)
    assert _block_n(128, fp8=True, single_warp=True, programs=256 * 8, num_sms=132) == 32
    assert _block_n(128, fp8=True, single_warp=True, programs=128 * 8, num_sms=132) == 32


# (cached prefix, new tokens) per sequence: a fresh prompt, chunks after cached prefixes
# (block aligned and not), a one-token chunk, and chunks longer than one query tile.
@pytest.mark.slow
@pytest.mark.parametrize("head_dim,block_size,num_heads,num_kv_heads,block_m,block_n", [
    (64, 16, 4, 2, 16, 16),
    (128, 32, 4, 1, 16, 32),
    (64, 32, 2, 2, 32, 16),
])
def test_prefill_attention_with_cached_prefix_matches_reference(
        head_dim, block_size, num_heads, num_kv_heads, block_m, block_n):
    check_prefill([(0, 37), (32, 13), (17, 1), (45, 20)], block_size, num_heads,
                  num_kv_heads, head_dim, block_m=block_m, block_n=block_n)


def test_empty_batches_launch_nothing():
    k_cache, v_cache, table = paged_kv([5], 16, 2, 64)
    empty = torch.empty(0, 4, 64, dtype=DTYPE, device=DEVICE)
    no_lens = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert decode_attention(empty, k_cache, v_cache, table[:0], no_lens, 1.0, 0).shape[0] == 0
    starts = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = prefill_attention(empty, k_cache, v_cache, table[:0], no_lens, starts, 0, 1.0)
    assert out.shape[0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("batch", [24, 96])   # split (3 chunks), unsplit (direct output)
def test_decode_attention_at_real_shapes(block_size, head_dim, batch):
    seq_lens = torch.randint(1, 4097, (batch,)).tolist()
    check_decode(seq_lens, block_size, 32, 8, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_prefill_attention_at_real_shapes(block_size, head_dim):
    check_prefill([(0, 1000), (700, 300), (2048, 1), (96, 517)], block_size, 32, 8, head_dim)


def test_decode_graphs_over_fp8_kv_are_captured_for_short_and_long_contexts():
    assert context_caps(4096, fp8_kv=True) == [1024, 4096]
    assert context_caps(1024, fp8_kv=True) == [1024] and context_caps(512, fp8_kv=True) == [512]
    assert context_caps(4096, fp8_kv=False) == [4096]     # a 16-bit cache launches alike
