"""The attention's own fp8 output: over an fp8 KV cache the attention kernels hand the FP8 o
projection its input as e4m3 in V's units, V's scale the scale of every row
(kernels/paged.py finish_output), so no per-token quantization runs between them.

An output row is a weighted average of V's e4m3 rows, so it lies within e4m3's range; the
checks are against the unquantized output's values: one e4m3 rounding (half a step) plus
the kernels' own tolerance. Kernels run under TRITON_INTERPRET=1 on CPU without a GPU.
"""
from tests.support.fp8_kv import ATTN_TOL, DEVICE, DTYPE, KV_SCALE, V_SCALE, fp8_caches

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.fp8_math import FP8, quantize  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from kernels.reference import decode_attention_ref, paged_attention_ref  # noqa: E402
from pd_cluster.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pd_cluster.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pd_cluster.models.fp8 import Fp8Activation, fp8_linear, quantize_weight  # noqa: E402
from pd_cluster.models.layers import RotaryEmbedding  # noqa: E402
from tests.support.attention import build_batch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def assert_v_units(got8: torch.Tensor, values: torch.Tensor) -> None:
    """An fp8 attention output (kernels/paged.py finish_output) against the output's values:
    got8 * V's scale rounds them to e4m3 (half a step, 1/16 relative; subnormals 2^-10 of
    the scale), and the kernels' fp16 P x V dot adds ATTN_TOL."""
    got = got8.float() * V_SCALE
    want = values.float()
    assert torch.all((got - want).abs() <= want.abs() / 16 + 2.0 ** -10 * V_SCALE
                     + ATTN_TOL * (1 + want.abs()))


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_writes_fp8_output_in_v_units(num_splits):
    seq_lens, heads, kv_heads, head_dim = [1, 37, 100, 70], 8, 2, 64
    _, (k8, v8), table = fp8_caches(seq_lens, 16, kv_heads, head_dim)
    q = torch.randn(len(seq_lens), heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out8 = torch.empty(q.shape, dtype=FP8, device=DEVICE)
    decode_attention(q, k8, v8, table, lens, head_dim ** -0.5, max(seq_lens), out=out8,
                     block_n=16, num_splits=num_splits, kv_scale=KV_SCALE)
    assert_v_units(out8, decode_attention_ref(q, k8, v8, table, lens, head_dim ** -0.5,
                                              KV_SCALE))


def test_prefill_kernel_writes_fp8_output_in_v_units():
    cached_and_new = [(0, 37), (32, 13), (17, 1)]
    seq_lens = [c + n for c, n in cached_and_new]
    heads, kv_heads, head_dim = 4, 2, 64
    _, (k8, v8), table = fp8_caches(seq_lens, 16, kv_heads, head_dim)
    q_lens = [n for _, n in cached_and_new]
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out8 = torch.empty(q.shape, dtype=FP8, device=DEVICE)
    prefill_attention(q, k8, v8, table, lens, starts, max(q_lens), head_dim ** -0.5, out=out8,
                      block_m=16, block_n=16, kv_scale=KV_SCALE)
    assert_v_units(out8, paged_attention_ref(q, k8, v8, table, lens, starts, head_dim ** -0.5,
                                             KV_SCALE))


def test_an_fp8_output_without_an_fp8_cache_is_refused():
    (k, v), _, table = fp8_caches([5], 16, 2, 64)
    q = torch.randn(1, 4, 64, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="fp8 output"):
        decode_attention(q, k, v, table, lens, 0.125, 5,
                         out=torch.empty(q.shape, dtype=FP8, device=DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("cached,new", [([40, 7, 100, 0, 33], [1, 1, 1, 21, 9])])
def test_backends_hand_the_fp8_o_projection_its_input_in_v_units(cached, new):
    """fp8_out: both backends give an Fp8Activation [T, heads * head_dim] with V's scale on
    every row, whose values are the backend's unquantized output's (the two backends' plain
    outputs are compared above)."""
    heads, kv_heads, head_dim, bs, num_blocks = 4, 2, 64, 16, 40
    meta = build_batch(cached, new, bs, num_blocks)
    tokens = sum(new)
    q = torch.randn(tokens, heads, head_dim, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
            for _ in range(2))
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None).to(DEVICE)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(DEVICE)
    cache = quantize(torch.randn(2, num_blocks, bs, kv_heads, head_dim, device=DEVICE), 1.0)
    outs = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend())):
        for fp8_out in (False, True):
            kv = cache.clone()
            outs[name, fp8_out] = backend.forward(q.clone(), k, v, positions, rope, kv[0], kv[1],
                                                  meta, head_dim ** -0.5, KV_SCALE, fp8_out)
    for name in ("torch", "triton"):
        act = outs[name, True]
        assert act.xq.dtype == FP8 and act.xq.shape == (tokens, heads * head_dim)
        assert act.dtype == DTYPE and torch.all(act.scale == V_SCALE)
        assert act.scale.shape == (tokens, 1)
        assert_v_units(act.xq, outs[name, False].reshape(tokens, -1))


def test_fp8_linear_takes_one_scale_shared_by_every_row():
    """The attention's Fp8Activation: one scale expanded over the rows, read in place."""
    x8 = quantize(torch.randn(5, 64, device=DEVICE), 1.0)
    w8, w_scale = quantize_weight(torch.randn(32, 64, device=DEVICE))
    shared = Fp8Activation.shared(x8, KV_SCALE[1], DTYPE)
    assert shared.scale.stride(0) == 0
    copied = Fp8Activation(x8, torch.full((5, 1), V_SCALE, device=DEVICE), DTYPE)
    torch.testing.assert_close(fp8_linear(shared, w8, w_scale), fp8_linear(copied, w8, w_scale),
                               atol=0, rtol=0)
