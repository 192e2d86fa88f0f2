"""FP8's kernels and GEMM: the per-token quantization kernel (bit for bit against torch),
`fp8_linear` against the float references (and on a GPU, in a CUDA graph), weight
quantization, the small-M W8A8 GEMM (kernels/fp8_linear.py) against its float reference, and
the RMSNorm / SiLU-and-mul kernels that quantize their own output against the unfused kernel
followed by the per-token quant (bit for bit: the GEMM then reads the very bytes it read
before the fusion).

Measured: one FP8 GEMM (e4m3: 3 mantissa bits) is 2.5-3 % off the float product (relative
norm). Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (their e4m3 casts made
right by kernels/testing.py); on an H100 (torch 2.11) the quant kernel matched its reference
bit for bit too."""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.fp8_linear import fp8_linear_small, fp8_linear_small_ref, takes, tiles  # noqa: E402
from kernels.fp8_math import FP8, MIN_SCALE, per_token_quant_ref  # noqa: E402
from kernels.fp8_quant import ONE_PASS_MAX, per_token_quant  # noqa: E402
from kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from pd_cluster.models import fp8, ops  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
MIN_SCALE_F32 = float(np.float32(MIN_SCALE))     # as a float32 tensor holds it


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- the per-token quantization kernel ------------------------------------------------------

# Rows loaded whole (K <= ONE_PASS_MAX) and rows read in BLOCK chunks with a ragged tail;
# every input dtype; rows of zeros (scale MIN_SCALE) and outliers.
@pytest.mark.parametrize("tokens,k,dtype", [(5, 70, torch.float32), (3, 2500, torch.bfloat16),
                                            (4, 64, torch.float16), (1, 1, torch.float32),
                                            (2, ONE_PASS_MAX + 1500, torch.bfloat16)])
def test_quant_kernel_matches_reference_bit_for_bit(tokens, k, dtype):
    x = torch.randn(tokens, k, dtype=dtype, device=DEVICE) * 3
    if tokens > 1:
        x[1] = 0
        x[0, k // 2] = 6e4 if dtype == torch.float16 else 1e5
    xq, scale = per_token_quant(x)
    xq_ref, scale_ref = per_token_quant_ref(x)
    assert xq.dtype == FP8 and xq.shape == x.shape and scale.shape == (tokens, 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))
    if tokens > 1:
        assert scale[1].item() == MIN_SCALE_F32 and not xq[1].float().any()
    # Each row's largest magnitude maps to e4m3's largest value, 448 (the zero row aside).
    amax = xq.float().abs().amax(1)
    assert torch.equal(amax[amax > 0], torch.full_like(amax, 448.0)[amax > 0])
    assert (amax > 0).sum() == tokens - (tokens > 1)
    # The model's torch path (CPU) is the same computation.
    xq_torch, scale_torch = fp8.quantize_per_token(x.cpu())
    assert torch.equal(scale_torch, scale_ref.cpu())
    assert torch.equal(xq_torch.view(torch.uint8), xq_ref.view(torch.uint8).cpu())


def test_quant_kernel_takes_strided_rows():
    x = torch.randn(6, 200, device=DEVICE)[:, 10:150]      # row stride 200, unit stride on K
    xq, scale = per_token_quant(x)
    xq_ref, scale_ref = per_token_quant_ref(x)
    assert torch.equal(scale, scale_ref) and torch.equal(xq.view(torch.uint8),
                                                         xq_ref.view(torch.uint8))


# -- the FP8 GEMM -----------------------------------------------------------------------------

@pytest.mark.parametrize("t,k,n,bias", [(7, 64, 48, False), (5, 70, 33, True), (1, 256, 96, True)])
def test_fp8_linear_matches_the_float_references(t, k, n, bias):
    torch.manual_seed(0)
    x, w = torch.randn(t, k), torch.randn(n, k) * k ** -0.5
    b = torch.randn(n) if bias else None
    w8, w_scale = fp8.quantize_weight(w)
    y = fp8.fp8_linear(x, w8, w_scale, b)
    assert y.shape == (t, n) and y.dtype == x.dtype
    # The exact math: the quantized operands dequantized with their scales, in float64.
    xq, x_scale = fp8.quantize_per_token(x)
    exact = (xq.double() * x_scale.double()) @ (w8.double() * w_scale.double()[:, None]).t()
    exact = exact + (b.double() if bias else 0)
    assert rel(y, exact) < 1e-6
    # torch's own CPU _scaled_mm (an emulation of the same math): float32 rounding apart.
    # Row-wise scales on the CPU came with torch 2.13 (the version CI pins); 2.11's CPU kernel
    # takes per-tensor scales only (seen on a GPU machine's image).
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        scaled = torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=w_scale.view(1, n),
                                  bias=b, out_dtype=torch.float32)
        assert rel(y, scaled) < 1e-6
    # Against the unquantized product: e4m3's rounding of both operands, measured 2.5-3 %.
    assert rel(y, x @ w.t() + (b if bias else 0)) < 0.05
    # Leading dimensions are flattened and restored.
    assert torch.equal(fp8.fp8_linear(x.view(1, t, k), w8, w_scale, b), y.view(1, t, n))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 5e-3), (torch.float32, 1e-3)])
@pytest.mark.parametrize("t,k,n", [(64, 4096, 6144), (7, 70, 33)])
def test_fp8_linear_on_the_gpu_and_in_a_cuda_graph(t, k, n, dtype, tolerance):
    """_scaled_mm (or, for 70 x 33, the float32 path) against the exact math. Measured on an
    H100 (torch 2.11): bf16 out 2.1-2.4e-3 (its rounding), float32 out under 1e-4."""
    x = torch.randn(t, k, device="cuda", dtype=dtype)
    w8, w_scale = fp8.quantize_weight(torch.randn(n, k, device="cuda") * k ** -0.5)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    y = fp8.fp8_linear(x, w8, w_scale, bias)
    xq, x_scale = fp8.quantize_per_token(x)
    exact = (xq.double() * x_scale.double()) @ (w8.double() * w_scale.double()[:, None]).t()
    assert y.dtype == dtype and rel(y, exact + bias.double()) < tolerance
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8.fp8_linear(x, w8, w_scale, bias)       # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8.fp8_linear(x, w8, w_scale, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, fp8.fp8_linear(x, w8, w_scale, bias))


def test_quantize_weight_round_trip():
    torch.manual_seed(1)
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 40)[:, None]    # rows of any magnitude
    w[3] = 0
    w8, scale = fp8.quantize_weight(w)
    assert w8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert scale[3].item() == MIN_SCALE_F32 and not w8[3].float().any()
    live = [i for i in range(40) if i != 3]
    assert torch.equal(w8[live].float().abs().amax(1), torch.full((39,), 448.0))
    # Normal e4m3 values are off by at most half a step (2^-4 relative); subnormals (below
    # 2^-6 of the scale) by at most half the smallest step, 2^-10 of the scale.
    err = (fp8.dequantize_weight(w8, scale) - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, scale[:, None] * 2 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    # Given scales (a row-parallel rank's, from the whole rows): the same values as slicing.
    w8_half, _ = fp8.quantize_weight(w[:, :35], scale)
    assert torch.equal(w8_half.view(torch.uint8), w8[:, :35].view(torch.uint8))


# -- the small-M GEMM and the quantizing norm / activation ----------------------------------

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
            for h200 in (False, True):
                if not takes(m, n):
                    continue
                block_n, block_k, stages = tiles(m, n, k, h200)
                # the pipeline's x and w tiles (BLOCK_M <= 64 rows) fit an SM's shared memory
                assert block_n * block_k <= 512 * 64 and 3 <= stages <= 8
                assert stages * (64 + block_n) * block_k <= 232448
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
    assert xq.dtype == FP8 and same_bytes(xq, ref_q) and torch.equal(scale, ref_scale)


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
