"""A MoE router's choice after its logits, in one kernel: the scores (softmax or sigmoid),
the top-k experts (by score, or by score plus a correction bias), their weights renormalised
and scaled (issue 45).

    logits   [T, E]  fp32 or the model dtype, rows contiguous
    bias     [E] fp32, or None: it moves the choice, never the weights (DeepSeek-V3's
             noaux_tc correction bias)
    ->  weights [T, K] in `dtype`, ids [T, K] int64, best first

    weights = scores of the chosen experts, / (their sum + eps) when renormalised, x scale

A decode step otherwise runs the softmax, the top-k, a gather, the renormalisation and the
casts as half a dozen kernels per MoE layer (about 17 us on an H200 at DeepSeek-V2-Lite's
batch 64, the top-k alone 6 us). One program per token does them on its row, in fp32.
Routing by groups (group_limited_greedy, V3's noaux_tc with topk_group < n_group) is not done
here: pd_cluster/models/deepseek_moe.py keeps it in torch. Reference:
kernels/reference.py `router_topk_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, wait_for_inputs

MAX_EXPERTS = 1024      # a row of scores in one program's registers


@triton.jit
def _router_topk_kernel(Logits, Bias, Weights, Ids, stride_l, eps, scale, num_experts,
                        TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                        SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                        PDL: tl.constexpr):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    real = e < num_experts
    x = tl.load(Logits + t * stride_l + e, mask=real, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 0))
        scores = p / tl.sum(p, 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(Bias + e, mask=real, other=0.0)
    choice = tl.where(real, choice, float("-inf"))
    k = tl.arange(0, K_POW2)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0)
        ids = tl.where(k == i, best, ids)
        weights = tl.where(k == i, tl.sum(tl.where(e == best, scores, 0.0), 0), weights)
        choice = tl.where(e == best, float("-inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, 0) + eps)      # the padded slots hold 0
    weights = weights * scale
    tl.store(Weights + t * TOP_K + k, weights.to(Weights.dtype.element_ty), mask=k < TOP_K)
    tl.store(Ids + t * TOP_K + k, ids.to(tl.int64), mask=k < TOP_K)


def router_topk(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool,
                renormalize: bool, eps: float, scale: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in dtype, ids [T, K] int64) of logits [T, E] (module docstring)."""
    t, experts = logits.shape
    assert logits.stride(-1) == 1 and top_k <= experts <= MAX_EXPERTS, (logits.shape, top_k)
    weights = torch.empty(t, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _router_topk_kernel[(t,)](
        logits, logits if bias is None else bias, weights, ids, logits.stride(0), eps, scale,
        experts, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
        E_POW2=triton.next_power_of_2(experts), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
        RENORM=renormalize, num_warps=1 if experts <= 128 else 4, **pdl_args(logits.device))
    return weights, ids
