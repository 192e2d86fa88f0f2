"""FP8 (float8_e4m3fn) constants and quantization in torch: the one home of both.

Every FP8 path takes them from here: the weights and activations of the FP8 linear layers
(pd_cluster/models/fp8.py), the FP8 KV cache's stores (pd_cluster/kv_scales.py, the torch
attention backend, kernels/reference.py), and the Triton kernels' constants (kernels/paged.py,
kernels/fp8_quant.py), so that all of them saturate and round alike. It lives in kernels/,
which imports nothing from pd_cluster, so both packages can use it; it imports torch alone (no
Triton), so it also loads where the kernels cannot.

A quantized value means e4m3 * scale: quantizing divides by the scale in float32, saturates
to +-FP8_MAX (torch's cast would turn anything past it into NaN) and rounds to nearest even.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                         # e4m3's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)     # a dynamic scale's floor: a row of zeros gets it (vLLM's)


def saturate(x: torch.Tensor) -> torch.Tensor:
    """x, already in e4m3's units, as e4m3: clamped to +-FP8_MAX first."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale as e4m3 (a scale broadcasts against x: one per tensor, row or token)."""
    return saturate(x.float() / scale)


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K] e4m3, scale [T, 1] float32): dynamic, one scale per token,
    max(amax(|x[t]|) / FP8_MAX, MIN_SCALE). kernels/fp8_quant.py's kernel gives the same bits."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # Divided by a tensor: CUDA torch multiplies by the reciprocal of a Python-number divisor
    # (not IEEE division, which the kernel does). full_like, not torch.tensor: no host copy,
    # so a CUDA graph can capture it.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return quantize(xf, scale), scale
