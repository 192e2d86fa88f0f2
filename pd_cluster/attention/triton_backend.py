"""Triton attention backend: the `kernels` package behind the AttentionBackend protocol.

One forward rotates q and stores the rotated K and V (rope_store_kv, one kernel), then runs
split-KV decode attention on the leading `num_decode_tokens` tokens and varlen paged prefill
attention on the rest; either part may be empty. An fp8 KV cache comes with its layer's
`kv_scale` ([K scale, V scale] float32 on the device), which every kernel reads; with
`fp8_out` the kernels write the output as e4m3 in V's units, the FP8 o projection's input. Needs a GPU, or TRITON_INTERPRET=1 on CPU (slow: tests only).
"""
from __future__ import annotations

import torch

from kernels.decode_attention import decode_attention
from kernels.fp8_math import FP8
from kernels.prefill_attention import prefill_attention
from kernels.rope import rope_store_kv
from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.models.fp8 import Fp8Activation


class TritonAttentionBackend:
    """Paged attention with Triton kernels; same results as TorchAttentionBackend."""

    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                rope, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, kv_scale: torch.Tensor | None = None,
                fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
        rope_store_kv(q, k, v, positions, rope.cos_sin, k_cache, v_cache, meta.slot_mapping,
                      kv_scale)
        quantized = fp8_out and kv_scale is not None
        out = torch.empty(q.shape, dtype=FP8 if quantized else q.dtype, device=q.device)
        num_decodes = meta.num_decode_tokens
        if num_decodes > 0:
            decode_attention(q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                             meta.seq_lens[:num_decodes], scale,
                             max_seq_len=max(meta.seq_lens_cpu[:num_decodes]),
                             out=out[:num_decodes], kv_scale=kv_scale)
        if q.shape[0] > num_decodes:
            # Prefill sequences follow the decodes; rebase their offsets to q[num_decodes:].
            prefill_attention(q[num_decodes:], k_cache, v_cache,
                              meta.block_tables[meta.num_decodes:],
                              meta.seq_lens[meta.num_decodes:],
                              meta.query_start_loc[meta.num_decodes:] - num_decodes,
                              meta.max_query_len, scale, out=out[num_decodes:],
                              kv_scale=kv_scale)
        if quantized:
            return Fp8Activation.shared(out.view(q.shape[0], -1), kv_scale[1], q.dtype)
        return out
