"""FP8 (e4m3) linear layers' math: weights quantized per output channel, activations per token.

    w        [N, K]  16-bit (or fp32) weight, as a checkpoint holds it
    w8       [N, K]  float8_e4m3fn                 w ~ w8 * w_scale[:, None]
    w_scale  [N]     float32, max(amax(|w[n]|) / 448, MIN_SCALE)
    x        [T, K]  the layer's input (bf16, fp16 or fp32)
    xq       [T, K]  float8_e4m3fn                 x ~ xq * x_scale
    x_scale  [T, 1]  float32, max(amax(|x[t]|) / 448, MIN_SCALE), computed for every call
    y        [T, N]  x's dtype: (xq * x_scale) @ (w8 * w_scale[:, None]).T (+ bias)

On CUDA the GEMM runs on the FP8 tensor cores: kernels/fp8_linear.py's Triton kernel for the
decode-sized shapes it is faster at, else `torch._scaled_mm` with row-wise scales (scale_a
x_scale [T, 1], scale_b w_scale [1, N]). x is quantized by the Triton kernel of
kernels/fp8_quant.py, or arrives quantized (`Fp8Activation`) from the RMSNorm or
SiLU-and-mul kernel that produced it, or from the attention over an fp8 KV cache (the o
projection's input, scaled by V's scale: kernels/paged.py finish_output). Row-wise scales need sm89+ (Ada, Hopper), and _scaled_mm refuses K or N
not a multiple of 16 (seen on an H100, torch 2.11): older GPUs, and layers of such shapes
(none in real Llama-family models; the tiny test models' dims are multiples of 16 too), take
the float32 path below, on the GPU, rather than padding: slower, but only where it is rare.

On the CPU the GEMM is that float32 path: dequantize xq and w8 with their scales and multiply.
torch 2.13's CPU `_scaled_mm` supports what we need (per-tensor and row-wise scales, float32 /
bf16 / fp16 out, a bias), but only as an emulation doing exactly this math (its CPU
kernel casts both operands to float32, multiplies the scales in, makes w8.T contiguous, and
calls matmul; on a CPU with AMX it goes to oneDNN instead), and it measured about twice as
slow as doing it here (64x2048x2048 on this machine's 2 cores: 24.7 against 13.2 ms) because of
that copy of the weight. The results agree to float32 rounding (tests/pd_cluster/models/test_fp8_weights.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.fp8_math import FP8_MAX, MIN_SCALE, per_token_quant_ref, quantize


def quantize_weight(w: torch.Tensor, scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w8 [N, K] e4m3, scale [N] float32), one scale per output row.

    `scale` [N], when given, is used instead of the rows' own: a row-parallel rank quantizes
    its columns of w with the scales of the whole rows, so that its w8 is exactly its slice
    of the unsplit layer's."""
    scale = row_scales(w) if scale is None else scale.float()
    return quantize(w, scale[:, None]), scale


def row_scales(w: torch.Tensor) -> torch.Tensor:
    """The per-row scales `quantize_weight` gives w [N, K]: [N] float32."""
    return (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, x_scale [T, 1] float32): dynamic, one scale per token.
    The Triton kernel on an sm89+ GPU, else torch; the two agree bit for bit."""
    if x.is_cuda and _fp8_gpu(x.device) and x.stride(-1) == 1:
        kernel = _quant_kernel()
        if kernel is not None:
            return kernel(x)
    return per_token_quant_ref(x)


@dataclass(frozen=True, slots=True)
class Fp8Activation:
    """An activation already quantized by the op that produced it, so the GEMM reading it
    launches no quant of its own: xq [..., K] e4m3, scale [..., 1] float32, dtype the
    activation's (and the GEMM output's) own. The FP8 layers' RMSNorms and SiLU-and-mul
    (`pd_cluster.models.ops`) quantize per token, as `quantize_per_token` would; attention over
    an fp8 KV cache gives its output in V's units with V's scale for every row (`shared`)."""

    xq: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.xq.shape

    @staticmethod
    def shared(xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> "Fp8Activation":
        """xq [T, K] whose rows share one scale, a 1-element float32 tensor (expanded, not
        copied: a CUDA graph reads its value at replay)."""
        return Fp8Activation(xq, scale.reshape(1, 1).expand(xq.shape[0], 1), dtype)

    @staticmethod
    def of(x: torch.Tensor) -> "Fp8Activation":
        xq, scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
        return Fp8Activation(xq.view(x.shape), scale.view(*x.shape[:-1], 1), x.dtype)


def fp8_linear(x: torch.Tensor | Fp8Activation, w8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias with w = w8 * w_scale[:, None] and x quantized per token (module
    docstring), unless it comes quantized. x [..., K] -> y [..., N] in x's dtype."""
    act = x if isinstance(x, Fp8Activation) else Fp8Activation.of(x)
    shape = act.shape
    xq, x_scale = act.xq.reshape(-1, shape[-1]), act.scale.reshape(-1, 1)
    n, k = w8.shape
    m = xq.shape[0]
    gpu = xq.is_cuda and _fp8_gpu(xq.device)
    small = _small_kernel() if gpu else None
    if small is not None and small.takes(m, n) and xq.stride(-1) == 1:
        # Decode-sized batches: a Triton kernel that streams w8 faster than cuBLAS there.
        y = small.fp8_linear_small(xq, x_scale, w8, w_scale, act.dtype)
    elif gpu and k % 16 == 0 and n % 16 == 0:
        # contiguous(): an attention output's scale is one value expanded over the rows
        y = torch._scaled_mm(xq, w8.t(), scale_a=x_scale.contiguous(),
                             scale_b=w_scale.view(1, n),
                             out_dtype=act.dtype)
    else:
        # The exact math in float32 (the CPU path, and GPUs or shapes _scaled_mm cannot take).
        y = ((xq.float() * x_scale) @ (w8.float() * w_scale[:, None]).t()).to(act.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], n)


def dequantize_weight(w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """w8 * w_scale[:, None] in float32: the weight an FP8 layer multiplies by."""
    return w8.float() * w_scale[:, None]


@functools.cache
def _fp8_gpu(device: torch.device) -> bool:
    """FP8 tensor cores (sm89+): row-wise _scaled_mm and Triton's e4m3 casts."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _small_kernel():
    try:
        import kernels.fp8_linear as small
    except ImportError:         # no Triton: cuBLAS
        return None
    return small


@functools.cache
def _quant_kernel():
    try:
        from kernels.fp8_quant import per_token_quant
    except ImportError:         # no Triton: torch quantizes
        return None
    return per_token_quant
