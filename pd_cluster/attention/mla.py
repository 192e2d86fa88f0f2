"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent KV cache.

One layer's cache is [num_blocks, block_size, L + R] (pd_cluster/kv_layout.py, `latent`):
per token the normalised latent c (L = kv_lora_rank values) then the rotated RoPE key k_pe
(R = qk_rope_head_dim). Per query head h the model's key and value are

    k[h] = [W_UK[h] c ; k_pe]      v[h] = W_UV[h] c        (W_UK [H, N, L], W_UV [H, V, L]:
                                                             kv_b_proj's rows, per head)

so a score q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe. The batch's tokens
are split as the engine lays them out (pd_cluster/attention/base.py: decodes first):

- Decode tokens attend in the latent space ("absorbed"): q_latent[h] = W_UK[h]^T q_nope[h],
  one shared KV "head" of L + R values read once for every query head, the output
  o_latent[h] mapped back with W_UV[h]. Per cached token this reads L + R values instead of
  H (N + R + V): what makes MLA decode cheap. On a GPU with the Triton backend the kernel of
  kernels/mla_decode.py runs it; elsewhere `decode_reference`.
- Prefill tokens expand the latent of their context into per-head K and V and attend as
  ordinary multi-head attention. Absorbing here would cost H x L x (N + V) per query token
  more than it saves when the query is as long as its context; expanded is also what
  transformers computes, so chunked prefill matches it closely.

The torch code runs in fp32 and returns q's dtype, as pd_cluster/attention/torch_backend.py.
"""
from __future__ import annotations

import torch

from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.attention.torch_backend import gather_kv


def decode_reference(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The absorbed attention of the first len(q_latent) sequences (one query token each):
    q_latent [D, H, L], q_pe [D, H, R] -> o_latent [D, H, L] in fp32 (kernels/mla_decode.py's
    contract, with host lengths: no device sync)."""
    latent = q_latent.shape[-1]
    out = torch.empty(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    for i in range(q_latent.shape[0]):
        rows = gather_kv(cache, meta.block_tables[i], meta.seq_lens_cpu[i]).float()  # [S, L+R]
        q = torch.cat([q_latent[i], q_pe[i]], dim=-1).float()                        # [H, L+R]
        probs = (q @ rows.T * scale).softmax(-1)
        out[i] = probs @ rows[:, :latent]
    return out


def _decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from kernels.mla_decode import mla_decode
    d = q_latent.shape[0]
    # The kernel takes any head and token strides: q_pe stays a view of the query, and the
    # output is laid out [H, D, L] for the W_UV product that follows.
    out = torch.empty(q_latent.shape[1], d, q_latent.shape[2], dtype=q_latent.dtype,
                      device=q_latent.device).transpose(0, 1)
    return mla_decode(q_latent, q_pe, cache, meta.block_tables[:d], meta.seq_lens[:d], scale,
                      max_seq_len=max(meta.seq_lens_cpu[:d]), out=out)


def prefill_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                     block_table: torch.Tensor, seq_len: int, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's query tokens (the last q_len of its seq_len positions; q_nope
    [q_len, H, N], q_pe [q_len, H, R]) attending causally to its whole context, the latent
    expanded into per-head K and V -> [q_len, H, V] fp32."""
    latent = w_uk.shape[-1]
    rows = gather_kv(cache, block_table, seq_len).float()                  # [S, L + R]
    c, k_pe = rows[:, :latent], rows[:, latent:]
    k_nope = torch.einsum("sl,hnl->hsn", c, w_uk.float())                 # [H, S, N]
    v = torch.einsum("sl,hvl->hsv", c, w_uv.float())                      # [H, S, V]
    scores = (torch.einsum("qhn,hsn->hqs", q_nope.float(), k_nope)
              + torch.einsum("qhr,sr->hqs", q_pe.float(), k_pe)) * scale
    q_len = q_nope.shape[0]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=rows.device)[:, None]
    k_pos = torch.arange(seq_len, device=rows.device)[None, :]
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqs,hsv->qhv", scores.softmax(-1), v)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  meta: AttentionMetadata, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                  kernel: bool = False) -> torch.Tensor:
    """Attend every query token to its context, the new tokens' entries already in the cache
    (`write_latent`; module docstring). q_nope [T, H, N], q_pe [T, H, R] (rotated), cache
    [num_blocks, block_size, L + R], w_uk [H, N, L], w_uv [H, V, L] -> [T, H, V] in q's
    dtype. `kernel`: decode with the Triton kernel."""
    t, h = q_nope.shape[:2]
    out = torch.empty(t, h, w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    d = meta.num_decode_tokens
    if d:
        # Batched over heads: [H, D, N] @ [H, N, L], both views, no copies.
        q_latent = torch.bmm(q_nope[:d].transpose(0, 1), w_uk).transpose(0, 1)
        decode = _decode_triton if kernel else decode_reference
        o_latent = decode(q_latent, q_pe[:d], cache, meta, scale)
        out[:d] = torch.bmm(o_latent.to(w_uv.dtype).transpose(0, 1),
                            w_uv.transpose(1, 2)).transpose(0, 1)
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        out[start:end] = prefill_expanded(q_nope[start:end], q_pe[start:end], cache,
                                          meta.block_tables[i], meta.seq_lens_cpu[i], w_uk,
                                          w_uv, scale)
    return out
