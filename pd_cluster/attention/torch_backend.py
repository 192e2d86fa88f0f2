"""Pure torch attention over the paged KV cache: the reference that runs on any device.

An fp8 cache (float8_e4m3fn, `kv_scale` = [K scale, V scale] float32) stores value / scale
saturated to +-448 and is read back as fp8 * scale; the attention itself runs in fp32. With
`fp8_out` the output stays in V's units as e4m3, V's scale its scale: the FP8 o projection's
input, as the Triton kernels give it.
"""
from __future__ import annotations

import torch

from kernels.fp8_math import FP8, quantize, saturate
from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.models.fp8 import Fp8Activation


def _stored(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.to(cache.dtype) if scale is None else quantize(x, scale)


def _read(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x.float() if scale is None else x.float() * scale


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Write each token's K/V to its KV cache slot (shapes as in `AttentionBackend.forward`);
    into an fp8 cache as k / k_scale, v / v_scale."""
    num_blocks, block_size = k_cache.shape[:2]
    k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = \
        _stored(k, k_cache, k_scale)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = \
        _stored(v, v_cache, v_scale)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence's K or V: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float,
                              kv_scale: torch.Tensor | None = None,
                              fp8_out: bool = False) -> torch.Tensor:
    """Causal attention of every query token to its sequence's cached context, in fp32 (an
    fp8 cache read as fp8 * its scale). fp8_out (an fp8 cache): the output as e4m3 in V's
    units, V read unscaled, as the kernels write it (kernels/paged.py finish_output)."""
    k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    if fp8_out:
        v_scale = None
    out = torch.empty(q.shape, dtype=FP8 if fp8_out else q.dtype, device=q.device)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, q_len = meta.seq_lens_cpu[i], end - start
        k = _read(gather_kv(k_cache, meta.block_tables[i], seq_len), k_scale)
        v = _read(gather_kv(v_cache, meta.block_tables[i], seq_len), v_scale)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        out[start:end] = saturate(o) if fp8_out else o.to(q.dtype)
    return out


class TorchAttentionBackend:
    """Runs anywhere; the engine's default on CPU and the reference for the Triton backend."""

    name = "torch"

    def forward(self, q, k, v, positions, rope, k_cache, v_cache, meta: AttentionMetadata,
                scale: float, kv_scale: torch.Tensor | None = None, fp8_out: bool = False):
        q, k = rope(positions, q, k)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
        quantized = fp8_out and kv_scale is not None
        out = paged_attention_reference(q, k_cache, v_cache, meta, scale, kv_scale, quantized)
        if quantized:
            return Fp8Activation.shared(out.view(q.shape[0], -1), kv_scale[1], q.dtype)
        return out
