"""RoPE + KV store, RMSNorm and SiLU-and-mul kernels against their torch references.

Without a GPU they run under TRITON_INTERPRET=1 on CPU; with one, on the GPU.
These kernels use no tl.dot, so bf16 is checked on CPU too; the interpreter truncates when it
casts fp32 to bf16 (the GPU rounds to nearest), so bf16 results may differ by one ulp there.
"""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref, store_kv_ref  # noqa: E402
from kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels.rope import build_cos_sin_cache, rope_store_kv  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.bfloat16]
# Both sides compute in fp32; differences are only in the final rounding / reduction order.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Real shapes need a CUDA GPU: those tests are marked gpu (skipped without one: conftest.py).


def check_rope_store_kv(tokens, num_heads, num_kv_heads, head_dim, rotary_dim, block_size,
                        max_pos, theta, dtype, device, atol):
    """q rotated in place, rotated k and v at their slots (a padding slot stores nothing, and
    slots nobody owns keep their contents), k itself unchanged: all as the references do."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device) / rotary_dim))
    cache = build_cos_sin_cache(inv_freq, max_pos=max_pos)
    # q, k, v as strided views of one fused qkv projection, as the model produces them.
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, device=device, dtype=dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    k_before = k.clone()
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    num_blocks = -(-tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[tokens // 2] = -1
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                    device=device, dtype=dtype) for _ in range(2))
    ref_q, ref_k = rope_ref(q, k, positions, cache)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    store_kv_ref(ref_k, v, ref_k_cache, ref_v_cache, slots)
    rope_store_kv(q, k, v, positions, cache, k_cache, v_cache, slots)
    torch.testing.assert_close(q, ref_q, atol=atol, rtol=atol)
    torch.testing.assert_close(k_cache, ref_k_cache, atol=atol, rtol=atol)
    assert torch.equal(v_cache, ref_v_cache) and torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,block_size", [(64, 64, 16), (128, 128, 32),
                                                            (64, 32, 16)])
def test_rope_store_kv_rotates_q_and_stores_rotated_k_and_v(dtype, head_dim, rotary_dim,
                                                          block_size):
    check_rope_store_kv(11, 4, 2, head_dim, rotary_dim, block_size, 50, 10000.0, dtype,
                        DEVICE, ATOL[dtype])


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
def test_silu_and_mul(dtype):
    gate_up = torch.randn(3, 2 * 1100, device=DEVICE, dtype=dtype)  # 1100: two tiles, ragged
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up),
                               atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.gpu
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
    check_rope_store_kv(tokens, 32, 8, 128, 128, 16, 8192, 500000.0, dtype, "cuda", 2e-2)
