"""Plain torch references for every kernel in this package; tests compare against these.

Shapes follow the kernels' docstrings:
    paged K/V cache  [num_blocks, block_size, num_kv_heads, head_dim]; slot s -> block
                     s // block_size, offset s % block_size
    queries          [T, num_heads, head_dim], flattened over sequences by query_start_loc
    kv_scale         [2] float32 (K scale, V scale) of an fp8 (e4m3) cache: a stored value
                     means fp8 * scale; None for a cache in the model's (16/32-bit) dtype
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_math import quantize


def dequantize_ref(cache: torch.Tensor, scale: torch.Tensor | float | None) -> torch.Tensor:
    """A cache's values in fp32: fp8 * scale, or the values themselves (scale None)."""
    return cache.float() if scale is None else cache.float() * scale


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale) -> torch.Tensor:
    return quantize(x, scale) if scale is not None else x.to(cache.dtype)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> None:
    """Write k/v [T, num_kv_heads, head_dim] to their slots; negative slots are skipped.
    With `kv_scale` the caches are fp8 and hold k / k_scale, v / v_scale (saturated)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k_cache.view(-1, *k_cache.shape[2:])[slots] = _to_cache(k[keep], k_cache, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = _to_cache(v[keep], v_cache, v_scale)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention in fp32: query j of sequence i (q_len tokens, seq_len context after
    the step) sits at position seq_len - q_len + j and sees positions 0..its own. An fp8
    cache is read as fp8 * its scale (`kv_scale`), against q rounded to float16 as the
    kernels do (their tiles are widened to float16, kernels/paged.py dot_dtype)."""
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        blocks = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        k = dequantize_ref(k_cache[blocks].flatten(0, 1)[:seq_len], k_scale)
        v = dequantize_ref(v_cache[blocks].flatten(0, 1)[:seq_len], v_scale)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qs = q[start:end] if kv_scale is None else q[start:end].to(torch.float16)
        scores = torch.einsum("qhd,khd->hqk", qs.float(), k) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, num_heads, head_dim] -> [B, num_heads, head_dim]."""
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               scale, kv_scale)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm after an optional residual add: returns (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary (HF rotate_half) on the first rotary_dim dims of q [T, H, D], k [T, Hk, D].

    cos_sin_cache [max_pos, rotary_dim] holds cos in its first half, sin in its second.
    """
    half = cos_sin_cache.shape[1] // 2
    cos, sin = cos_sin_cache[positions.long()].float().split(half, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)

    return rotate(q), rotate(k)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleave: bool) -> torch.Tensor:
    """DeepSeek's RoPE: x [T, ..., R] rotated by its token's cos, sin [T, R / 2] (fp32) on
    pairs (x[2i], x[2i+1]) when `interleave`, else (x[i], x[i + R/2]); laid out
    [a cos - b sin | b cos + a sin] either way, in x's dtype."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def mla_rope_store_ref(q: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, interleave: bool, cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """kernels/mla_rope_store.py: q's RoPE parts (its last R values a head) rotated in place;
    each token's [weight * rmsnorm(c), rotated k_pe] of kv [T, L + R] to its slot of the
    latent cache [num_blocks, block_size, L + R]; negative slots skipped."""
    latent, rope = norm_weight.shape[0], 2 * cos.shape[-1]
    cos, sin = cos[positions], sin[positions]
    q[..., -rope:] = rotate_pairs(q[..., -rope:], cos, sin, interleave)
    c, _ = rms_norm_ref(kv[:, :latent], norm_weight, eps)
    entries = torch.cat([c, rotate_pairs(kv[:, latent:], cos, sin, interleave)], dim=-1)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = entries[keep].to(cache.dtype)


def router_topk_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                    sigmoid: bool, renormalize: bool, eps: float, scale: float,
                    dtype: torch.dtype, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/moe_router.py: each token's top_k experts by score (+ bias) and their weights
    (the scores, / (their sum + eps) when renormalised, x scale) in `dtype`, computed in fp32.
    `sorted` False: torch's unsorted top-k, which transformers' DeepSeek routers take (the
    ids' order only changes the order the experts' outputs are summed in)."""
    scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(-1)
    choice = scores if bias is None else scores + bias
    ids = torch.topk(choice, top_k, dim=-1, sorted=sorted)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return (weights * scale).to(dtype), ids


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] = [gate | up] -> [T, I] (HF LlamaMLP order)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in float64: the small-batch GEMM's reference."""
    return x.double() @ w.double().T
