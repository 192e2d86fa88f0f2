"""DeepSeek-V2/V3's mixture of experts: a grouped top-k router (`GroupedRouter`), the routed
experts of pd_cluster/models/moe.py (`Experts`, through ops.fused_moe), and shared experts
that every token runs.

Routing (pd_cluster/models/deepseek_config.py GroupedRouting), per token, in fp32 from an
fp32 router weight (DeepSeek keeps the gate in fp32 whatever the model dtype):

    greedy                 softmax scores, top-k experts
    group_limited_greedy   softmax; groups ranked by their best expert, the topk_group best
                           groups' experts compete for the top k
    noaux_tc (V3)          sigmoid scores; the choice reads scores + e_score_correction_bias,
                           groups ranked by the sum of their best two, topk_group kept
    then weights = the chosen experts' scores (without the bias), / their sum when
    norm_topk_prob, x routed_scaling_factor.

Under tensor parallelism the router and its choice are replicated, the routed experts split
as moe.py splits them and the shared experts as a dense MLP; each returns this rank's partial
sum, which the next RMSNorm reduces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster.config import ModelConfig
from pd_cluster.models.deepseek_config import GroupedRouting
from pd_cluster.models import ops
from pd_cluster.models.layers import GatedMLP
from pd_cluster.models.moe import SparseMoE
from pd_cluster.models.parallel import _parameter


def grouped_topk(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 routing: GroupedRouting) -> torch.Tensor:
    """scores [T, E] fp32 -> the chosen experts' ids [T, top_k] (module docstring)."""
    choice = scores if bias is None else scores + bias
    t, e = choice.shape
    if routing.method == "greedy" or routing.topk_group == routing.n_group:
        return torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    grouped = choice.view(t, routing.n_group, e // routing.n_group)
    group_scores = (grouped.max(dim=-1).values if routing.method == "group_limited_greedy"
                    else grouped.topk(2, dim=-1).values.sum(dim=-1))
    groups = torch.topk(group_scores, routing.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    # Experts of the dropped groups can never win: softmax scores are > 0, sigmoid ones too,
    # but a biased choice may be negative, so -inf rather than 0.
    masked = choice.masked_fill(~keep.repeat_interleave(e // routing.n_group, dim=1),
                                float("-inf"))
    return torch.topk(masked, top_k, dim=-1, sorted=False)[1]


class GroupedRouter(nn.Module):
    """x [T, hidden] -> (topk_weights [T, k] in x's dtype, topk_ids [T, k]), as fused_moe
    takes them."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool,
                 routing: GroupedRouting):
        super().__init__()
        self.top_k, self.renormalize, self.routing = top_k, renormalize, routing
        self.weight = _parameter((num_experts, hidden), (num_experts, hidden),
                                 dtype=torch.float32)
        # V3's load-balancing bias: it moves the choice, never the weights.
        self.e_score_correction_bias = (
            _parameter((num_experts,), (num_experts,), dtype=torch.float32)
            if routing.method == "noaux_tc" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        r = self.routing
        if r.method == "greedy" or r.topk_group == r.n_group:     # no groups to rank
            return ops.router_topk(logits, self.e_score_correction_bias, self.top_k,
                                   r.scoring == "sigmoid", self.renormalize, 1e-20,
                                   r.routed_scaling_factor, x.dtype, sorted=False)
        scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(-1)
        ids = grouped_topk(scores, self.e_score_correction_bias, self.top_k, self.routing)
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routing.routed_scaling_factor).to(x.dtype), ids


class DeepseekMoE(SparseMoE):
    """The MLP of a sparse DeepSeek layer: routed experts plus shared ones. x [T, hidden] ->
    this rank's partial sum [T, hidden]. A SparseMoE with its own router and the shared
    experts, so that it counts the routed experts as that does (moe.py `routed_counts`, which
    bench/tp_bench.py reads)."""

    def __init__(self, cfg: ModelConfig, expert_parallel: bool = False):
        routing = cfg.routing
        super().__init__(cfg, expert_parallel,
                         GroupedRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                       cfg.norm_topk_prob, routing))
        self.shared_experts = None
        if routing.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size,
                                           cfg.moe_intermediate_size * routing.n_shared_experts,
                                           reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)
