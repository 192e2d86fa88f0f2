"""The FP8 decode path's kernels: the small-M W8A8 GEMM (kernels/fp8_linear.py) against its
float reference, and the RMSNorm / SiLU-and-mul kernels that quantize their own output
against the unfused kernel followed by the per-token quant (bit for bit: the GEMM then reads
the very bytes it read before the fusion). On the CPU under TRITON_INTERPRET=1."""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8_linear import fp8_linear_small, fp8_linear_small_ref, takes, tiles  # noqa: E402
from kernels.fp8_quant import per_token_quant_ref  # noqa: E402
from kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from pd_cluster.models import fp8, ops  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("m,n,k,out_dtype", [(3, 96, 64, torch.bfloat16),
                                             (17, 160, 96, torch.float16),
                                             (70, 64, 512, torch.bfloat16),   # two row tiles
                                             (5, 33, 70, torch.float32)])     # ragged N and K
def test_small_m_fp8_gemm_matches_its_float_reference(m, n, k, out_dtype):
    torch.manual_seed(m)
    x = torch.randn(m, k, device=DEVICE)
    xq, x_scale = per_token_quant_ref(x)
    w8, w_scale = fp8.quantize_weight(torch.randn(n, k, device=DEVICE) * k ** -0.5)
    y = fp8_linear_small(xq, x_scale, w8, w_scale, out_dtype, block_n=32, block_k=64)
    ref = fp8_linear_small_ref(xq, x_scale, w8, w_scale, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    # float32 accumulation in another order, then one rounding to out_dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    torch.testing.assert_close(y, ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_small_m_kernel_has_tiles_for_every_shape_it_takes():
    # Llama-3.1-8B's decoder GEMMs (qkv, o, gate_up, down) at the batch sizes it takes.
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for m in (1, 64, 128, 256):
            if takes(m, n):
                block_n, block_k, stages = tiles(m, n, k)
                assert block_n * block_k <= 512 * 64 and stages in (3, 4)
    assert takes(64, 28672) and not takes(128, 28672) and not takes(256, 6144)
    assert not takes(257, 4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantized_in_its_kernel_equals_norm_then_quant(dtype, with_residual):
    torch.manual_seed(1)
    x = torch.randn(6, 96, device=DEVICE, dtype=dtype) * 3
    x[2] = 0                       # a row of zeros takes MIN_SCALE
    weight = torch.rand(96, device=DEVICE, dtype=dtype) + 0.5
    if with_residual:
        residual = torch.randn_like(x)
        (xq, scale), new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, quantize=True)
        out, ref_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(new_residual, ref_residual)
    else:
        xq, scale = rms_norm(x, weight, 1e-6, quantize=True)
        out = rms_norm(x, weight, 1e-6)
    ref_q, ref_scale = per_token_quant_ref(out)
    assert xq.dtype == fp8.FP8 and same_bytes(xq, ref_q) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_quantized_in_its_kernel_equals_silu_then_quant(dtype):
    torch.manual_seed(2)
    gate_up = torch.randn(5, 2 * 1100, device=DEVICE, dtype=dtype) * 4   # 1100: not a power of 2
    xq, scale = silu_and_mul(gate_up, quantize=True)
    ref_q, ref_scale = per_token_quant_ref(silu_and_mul(gate_up))
    assert same_bytes(xq, ref_q) and torch.equal(scale, ref_scale)


def test_fp8_linear_takes_a_quantized_activation_as_it_takes_the_tensor():
    """What the FP8 layers do (the norm hands over an Fp8Activation) gives the result of
    quantizing inside fp8_linear; on the CPU ops quantize with torch."""
    torch.manual_seed(3)
    x, weight = torch.randn(4, 64), torch.rand(64) + 0.5
    w8, w_scale = fp8.quantize_weight(torch.randn(48, 64))
    act = ops.rms_norm(x, weight, 1e-6, quantize=True)
    assert isinstance(act, fp8.Fp8Activation) and act.shape == (4, 64)
    plain = ops.rms_norm(x, weight, 1e-6)
    assert torch.equal(fp8.fp8_linear(act, w8, w_scale), fp8.fp8_linear(plain, w8, w_scale))
    gate_up = torch.randn(4, 128)
    act = ops.silu_and_mul(gate_up, quantize=True)
    assert torch.equal(fp8.fp8_linear(act, w8, w_scale),
                       fp8.fp8_linear(ops.silu_and_mul(gate_up), w8, w_scale))
