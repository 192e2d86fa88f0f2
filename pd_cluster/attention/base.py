"""Attention backend interface and the per-forward attention metadata.

Paged KV layout (one tensor for the whole engine, see `pd_cluster.kv_layout`):

    kv_cache[layer, 0] = K cache   [num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[layer, 1] = V cache   [num_blocks, block_size, num_kv_heads, head_dim]

Token slot `s` of the KV cache lives at block `s // block_size`, offset `s % block_size`.

A latent cache (multi-head latent attention, DeepSeek) has one part a layer, kv_cache[layer, 0]
= [num_blocks, block_size, 1, L + R], which its models attend to themselves
(pd_cluster/attention/mla.py; the backend only says whether the Triton kernel decodes).

A forward pass runs over a flattened batch of tokens from several sequences. The scheduler
puts decodes first, so the first `num_decodes` sequences each contribute exactly one query
token and the rest are (chunked) prefills:

    tokens:  [d0][d1][d2][p0 p0 p0 p0][p1 p1]         T = 9, B = 5, num_decodes = 3
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = [ctx0+1, ctx1+1, ctx2+1, cached_p0 + 4, cached_p1 + 2]

Query token j of sequence i sits at absolute position seq_lens[i] - query_len_i + j and
attends (causally) to every position up to and including its own.

KV cache dtype: the model's, or float8_e4m3fn (`kv_cache_dtype: fp8`) with one K and one V
scale per layer (a stored value means fp8 * scale): the backend then gets the layer's
`kv_scale`, a [2] float32 tensor (K scale, V scale) on the cache's device
(pd_cluster/kv_scales.py says where the scales come from).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pd_cluster.models.fp8 import Fp8Activation
    from pd_cluster.models.layers import RotaryEmbedding


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer of one forward pass needs; built once per step."""

    slot_mapping: torch.Tensor     # [T] int64: KV cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor         # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor     # [B, max_blocks_per_seq] int32, padded with 0
    num_decodes: int               # leading sequences with query length 1
    num_decode_tokens: int         # == num_decodes; kept separate for readability at call sites
    max_query_len: int
    max_seq_len: int
    # Host copies: the torch backend loops over sequences, and launchers size grids from them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """Applies RoPE to the new q and k, stores the new K/V into the paged cache, then attends
    every query to its context. (RoPE belongs here so that a backend can fuse it with the
    store: one kernel per layer instead of two.) q may be rotated in place; k is not changed.
    With fp8_out and an fp8 cache the output comes as an Fp8Activation [T, num_heads *
    head_dim]: e4m3 in V's units, V's scale for every row (an attention output is a convex mix
    of V's rows, so it needs no per-token scale), and no quantization runs before the FP8 o
    projection. Otherwise, a tensor in q's dtype."""

    name: str

    def forward(
        self,
        q: torch.Tensor,        # [T, num_heads, head_dim]
        k: torch.Tensor,        # [T, num_kv_heads, head_dim]
        v: torch.Tensor,        # [T, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [T] absolute positions of the new tokens
        rope: "RotaryEmbedding",
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,  # [2] float32 (K, V) of an fp8 cache; else None
        fp8_out: bool = False,  # an FP8 o projection reads the output (see below)
    ) -> torch.Tensor | Fp8Activation:      # [T, num_heads, head_dim]
        ...
