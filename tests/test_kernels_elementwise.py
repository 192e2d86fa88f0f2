"""kv_store, RMSNorm, RoPE and SiLU-and-mul kernels against their torch references.

Without a GPU they run under TRITON_INTERPRET=1 on CPU; with one, on the GPU.
These kernels use no tl.dot, so bf16 is checked on CPU too; the interpreter truncates when it
casts fp32 to bf16 (the GPU rounds to nearest), so bf16 results may differ by one ulp there.
"""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.kv_store import kv_store  # noqa: E402
from kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref, store_kv_ref  # noqa: E402
from kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels.rope import apply_rope, build_cos_sin_cache  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.bfloat16]
# Both sides compute in fp32; differences are only in the final rounding / reduction order.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
gpu_only = pytest.mark.skipif(INTERPRETED, reason="real shapes need a CUDA GPU")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_store_writes_each_token_to_its_slot(dtype, block_size):
    num_blocks, num_kv_heads, head_dim, tokens = 6, 2, 64, 11
    k = torch.randn(tokens, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1  # padding token: must not be written
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE,
                          dtype=dtype) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_hf_semantics(dtype, with_residual):
    x = torch.randn(5, 96, device=DEVICE, dtype=dtype)  # 96: not a power of two
    weight = torch.rand(96, device=DEVICE, dtype=dtype) + 0.5
    if with_residual:
        residual = torch.randn_like(x)
        out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
        ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
        torch.testing.assert_close(new_residual, ref_residual, atol=ATOL[dtype], rtol=ATOL[dtype])
    else:
        out, (ref_out, _) = rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rope_rotates_q_and_k_in_place(dtype, head_dim, rotary_dim):
    tokens, num_heads, num_kv_heads = 7, 4, 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE) / rotary_dim))
    cache = build_cos_sin_cache(inv_freq, max_pos=50)
    # q and k as strided views of one fused qkv projection, as the model produces them.
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    positions = torch.randint(0, 50, (tokens,), device=DEVICE)
    ref_q, ref_k = rope_ref(q, k, positions, cache)
    apply_rope(q, k, positions, cache)
    torch.testing.assert_close(q, ref_q, atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(k, ref_k, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gate_up = torch.randn(3, 2 * 1100, device=DEVICE, dtype=dtype)  # 1100: two tiles, ragged
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up),
                               atol=ATOL[dtype], rtol=ATOL[dtype])


@gpu_only
def test_elementwise_kernels_at_llama_8b_shapes():
    tokens, hidden, inter, dtype = 512, 4096, 14336, torch.bfloat16
    x, residual = (torch.randn(tokens, hidden, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    assert torch.equal(new_residual, ref_residual)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up),
                               atol=2e-2, rtol=2e-2)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda") / 128))
    cache = build_cos_sin_cache(inv_freq, max_pos=8192)
    q = torch.randn(tokens, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(tokens, 8, 128, device="cuda", dtype=dtype)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    ref_q, ref_k = rope_ref(q, k, positions, cache)
    apply_rope(q, k, positions, cache)
    torch.testing.assert_close(q, ref_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k, ref_k, atol=2e-2, rtol=2e-2)
