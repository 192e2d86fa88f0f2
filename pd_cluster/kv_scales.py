"""FP8 KV cache (`kv_cache_dtype: fp8`): its per-layer scales, where they come from, and how
each layer's attention gets its own.

The cache is float8_e4m3fn. Each layer has one float32 K scale and one V scale; a stored
value means fp8 * scale (stores write x / scale saturated to +-448: kernels/fp8_math.py
`quantize`). Scales are, per layer:
  - the checkpoint's, when it has them (the loader sets `model.kv_scales`: per layer a
    (k_scale, v_scale) pair, or None where a layer has none);
  - else calibrated at load (`calibrate`): one forward pass of a fixed synthetic prompt
    (CALIBRATION_TOKENS pseudo-random ids, the same on every engine) in the model's dtype,
    with a throwaway 16/32-bit cache; each layer's K and V amax becomes
    amax * CALIBRATION_HEADROOM / 448 rounded UP to a power of two, at least SCALE_FLOOR.
    Rounding to a power of two is what makes a prefill and a decode engine (even at
    different tensor-parallel sizes, whose sums round differently) derive bit-identical
    scales: their amaxes differ in the last bits, which only matters when one sits within
    those bits of a power of two. A power-of-two scale also makes x / scale exact.
    Tensor-parallel ranks each see their own KV heads: they take the max over the ranks.

Where the scales live: the engine's KVLayout (`kv_scales`, a tuple of (k, v) floats per
layer, pd_cluster/kv_layout.py), so they are part of the layout two engines compare before
exchanging blocks (a P and a D with different scales refuse to connect, as with different
dtypes), and on the device as a [num_layers, 2] float32 tensor (ModelRunner.kv_scale_tensor)
that the kernels read through a pointer, which CUDA graphs capture once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as tdist

from kernels.fp8_math import FP8_MAX
from pd_cluster import distributed as dist
from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster.forward_context import ForwardContext

CALIBRATION_TOKENS = 256
# Calibration runs one synthetic prompt; served prompts can go past its amax. Twice the
# calibrated amax fits before a store saturates: e4m3's relative precision is the same at
# any magnitude down to 2^-6 of the scale, so the margin costs only the bottom of the range
# (values under amax / 2^14 become subnormal), while saturating an outlier key distorts the
# very scores that matter most.
CALIBRATION_HEADROOM = 2.0
# The least calibrated scale: a layer whose calibration K or V is all (near) zero still gets
# a range up to 448 * 2^-10 = 0.44 rather than nothing.
SCALE_FLOOR = 2.0 ** -10

LayerScales = tuple[tuple[float, float], ...]    # per layer: (K scale, V scale)


def pow2_scale(amax: float, headroom: float = CALIBRATION_HEADROOM,
               floor: float = SCALE_FLOOR) -> float:
    """amax * headroom / FP8_MAX rounded up to a power of two, at least `floor`."""
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"KV calibration: amax {amax} is not a finite magnitude")
    wanted = amax * headroom / FP8_MAX
    if wanted <= floor:
        return floor
    mantissa, exp = math.frexp(wanted)      # wanted = mantissa * 2**exp, 0.5 <= mantissa < 1
    return math.ldexp(1.0, exp - 1 if mantissa == 0.5 else exp)


def calibration_ids(vocab_size: int, n: int) -> list[int]:
    """The synthetic prompt: fixed pseudo-random ids spread over the vocabulary."""
    return [(7919 * i + 17) % vocab_size for i in range(n)]


@torch.inference_mode()
def calibrate(model: Any, vocab_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device, max_tokens: int,
              block_size: int = 16) -> LayerScales:
    """Per-layer (K, V) power-of-two scales from one forward of the synthetic prompt (module
    docstring). Every tensor-parallel rank calls it (the forward's collectives need them all);
    all return the same scales."""
    n = max(1, min(CALIBRATION_TOKENS, max_tokens))
    blocks = -(-n // block_size)
    cache = torch.zeros((num_layers, 2, blocks, block_size, num_kv_heads, head_dim),
                        dtype=dtype, device=device)
    ids = torch.tensor(calibration_ids(vocab_size, n), dtype=torch.int64, device=device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        num_decodes=0, num_decode_tokens=0, max_query_len=n, max_seq_len=n,
        query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
    # The torch backend whatever the engine's: scales must not depend on the kernels.
    model(ids, positions, ForwardContext(meta, cache, TorchAttentionBackend()))
    amax = cache.abs().amax(dim=(2, 3, 4, 5)).float().cpu()     # [num_layers, 2]
    del cache
    if dist.get_tp().size > 1:
        tdist.all_reduce(amax, op=tdist.ReduceOp.MAX, group=dist.get_tp().cpu_group)
    return tuple((pow2_scale(float(k)), pow2_scale(float(v))) for k, v in amax.tolist())


def kv_scales_for(model: Any, calibrated: Any, num_layers: int) -> LayerScales:
    """The checkpoint's scales (`model.kv_scales`) where it has them, else `calibrated()`'s
    (called only when some layer lacks one)."""
    given = getattr(model, "kv_scales", None)
    if given is not None and len(given) != num_layers:
        raise ValueError(f"the checkpoint has KV scales for {len(given)} layers, the model "
                         f"{num_layers}")
    if given is not None and all(s is not None for s in given):
        return _checked(given)
    fallback = calibrated()
    if given is None:
        return fallback
    return _checked([s if s is not None else fallback[i] for i, s in enumerate(given)])


def _checked(scales: Sequence[Sequence[float]]) -> LayerScales:
    out = tuple((float(k), float(v)) for k, v in scales)
    for i, pair in enumerate(out):
        if not all(math.isfinite(s) and s > 0 for s in pair):
            raise ValueError(f"layer {i}'s KV scales {pair} are not positive finite numbers")
    return out


class ScaledKVBackend:
    """An attention backend over an fp8 KV cache: hands each layer's call its [K, V] scale
    row. The model passes the layer's K and V caches, views of the one KV cache tensor
    [num_layers, 2, ...]; the layer is where the K view starts in it. The rows are views of
    the scales tensor made once, so a captured CUDA graph reads fixed addresses."""

    def __init__(self, backend: Any, kv_cache: torch.Tensor, kv_scales: torch.Tensor):
        assert kv_cache.is_contiguous() and kv_scales.shape == (kv_cache.shape[0], 2)
        self.backend, self.name = backend, backend.name
        self._base, self._per_layer = kv_cache.storage_offset(), kv_cache.stride(0)
        self._rows = [kv_scales[i] for i in range(kv_scales.shape[0])]

    def layer_of(self, k_cache: torch.Tensor) -> int:
        return (k_cache.storage_offset() - self._base) // self._per_layer

    def forward(self, q, k, v, positions, rope, k_cache, v_cache, meta, scale,
                kv_scale: torch.Tensor | None = None, fp8_out: bool = False):
        if kv_scale is None:
            kv_scale = self._rows[self.layer_of(k_cache)]
        return self.backend.forward(q, k, v, positions, rope, k_cache, v_cache, meta, scale,
                                    kv_scale=kv_scale, fp8_out=fp8_out)
