"""A mixture-of-experts layer's experts: each token through the top-k experts its router chose,
their outputs summed with the router's weights.

    x             [T, H]        hidden states (bf16, fp16 or fp32)
    w13           [E, 2I, H]    each local expert's gate and up projections, stacked
                                (gate rows first, as Hugging Face's `gate_up_proj`)
    w2            [E, H, I]     each local expert's down projection
    topk_weights  [T, K]        the router's weights for each token's K experts
    topk_ids      [T, K]        the global ids of those experts (int32 or int64)
    first_expert  int           the global id of local expert 0: this rank holds experts
                                first_expert .. first_expert + E - 1 (expert parallelism);
                                tokens' choices outside that range contribute nothing here
    out           [T, H]        x's dtype: sum over k of topk_weights[t, k] *
                                down(silu(gate(x[t])) * up(x[t])) of expert topk_ids[t, k]

Rounding follows transformers' per-expert loop (Qwen3MoeExperts, MixtralExperts): each
expert's matmuls in the model dtype, the weight applied in the model dtype, and the products
added into the output in ascending expert order, so greedy decoding matches it token for
token. Under tensor parallelism each rank holds a slice of every expert's intermediate
dimension (I / tp) and its output is a partial sum; under expert parallelism it holds whole
experts (E / ep of them); either way the caller all-reduces.

FP8 experts (as the project's dense FP8 layers, pd_cluster/models/fp8.py): w13 and w2 in
float8_e4m3fn, each with one float32 scale per output channel,

    w13_scale     [E, 2I]       expert e's gate/up weight is w13[e] * w13_scale[e][:, None]
    w2_scale      [E, H]        its down weight is w2[e] * w2_scale[e][:, None]

and each matmul's input quantized per token (kernels/fp8_math.py per_token_quant_ref: x before
gate/up, silu(gate) * up before down); the matmul is then the dequantized product in
float32, rounded to the model dtype, and the rest as above.

`fused_moe_ref` is the torch reference every implementation is checked against;
kernels/fused_moe_triton.py holds the GPU one (Triton). This module imports torch alone, so
the reference loads where Triton does not.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_math import per_token_quant_ref


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  first_expert: int = 0, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The module docstring's `out`, by a loop over the local experts that tokens chose
    (FP8 experts: w13 and w2 in e4m3 with their scales)."""
    out = torch.zeros_like(x)
    local = topk_ids.long() - first_expert
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        token, slot = torch.where(local == e)
        gate, up = _linear(x[token], w13[e], None if w13_scale is None else w13_scale[e]
                           ).chunk(2, dim=-1)
        y = _linear(F.silu(gate) * up, w2[e], None if w2_scale is None else w2_scale[e])
        y = y * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T in x's dtype; with `w_scale` w is e4m3 (the weight is w * w_scale[:, None]) and
    x is quantized per token first, the product of the dequantized operands taken in float32."""
    if w_scale is None:
        return F.linear(x, w)
    xq, x_scale = per_token_quant_ref(x)
    return ((xq.float() * x_scale) @ (w.float() * w_scale[:, None]).t()).to(x.dtype)
