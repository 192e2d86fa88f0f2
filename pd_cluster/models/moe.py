"""The mixture-of-experts MLP of Qwen3-MoE and Mixtral: a softmax router picks each token's
top-k experts, and `ops.fused_moe` runs them (kernels/fused_moe.py's contract).

Split over the tensor-parallel ranks (tokens are the same on every rank), one of two ways:

    tensor parallel (default)   every rank holds every expert's slice of the intermediate
                                dimension (I / tp): gate and up rows, down columns
    expert parallel             rank r holds whole experts r * E / tp .. (r + 1) * E / tp - 1
    (enable_expert_parallel)    and computes them for every token that chose them

Either way a rank's output is a partial sum, which the next RMSNorm all-reduces with its
residual add (as the dense GatedMLP's with reduce_results=False). The router is replicated,
so every rank routes alike.

Checkpoint layouts (both load): per expert, as published and as transformers' save_pretrained
writes them (`experts.{e}.gate_proj/up_proj/down_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1/w3/w2.weight`), or fused 3D tensors, transformers v5's
modules (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), which are also
this module's parameters.

Benchmarks count the experts each forward routes to (`COUNT_ROUTED` in the environment when
the model is built; `routed_counts` reads them): a decode step reads those experts' weights,
so their number per layer is its roofline's (bench/tp_bench.py). Off by default: the counting
adds four small kernels a layer, in the CUDA graphs too.
"""
from __future__ import annotations

import os
import re

import torch
from torch import nn

from pd_cluster.config import ModelConfig
from pd_cluster.distributed import get_tp
from pd_cluster.models import ops
from pd_cluster.models.parallel import _check_fits, _parameter

# "1": every SparseMoE built from now on counts the experts it routes to (module docstring).
COUNT_ROUTED = "PD_CLUSTER_COUNT_ROUTED"
# A per-expert checkpoint tensor: layer prefix, expert, projection.
_PER_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# Projection -> (our parameter, part); Mixtral's w1 / w3 / w2 are gate / up / down.
_PARTS = {"gate_proj": ("gate_up_proj", "gate"), "w1": ("gate_up_proj", "gate"),
          "up_proj": ("gate_up_proj", "up"), "w3": ("gate_up_proj", "up"),
          "down_proj": ("down_proj", "down"), "w2": ("down_proj", "down")}


def map_expert_name(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """A checkpoint name (without "model.") of a MoE layer -> (our parameter, shard), where
    shard is (expert, "gate" | "up" | "down") for a per-expert tensor and None for a fused
    or router one; None for a name of no MoE layer."""
    if (m := _PER_EXPERT.match(name)) is not None:
        param, part = _PARTS[m.group(3)]
        return f"{m.group(1)}.mlp.experts.{param}", (int(m.group(2)), part)
    if ".block_sparse_moe." in name:           # Mixtral's name of the MoE block
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


class Router(nn.Module):
    """Each token's top-k experts and their weights, rounded as transformers' routers:
    logits in the model dtype, softmax in fp32, top-k, renormalised (norm_topk_prob), then
    the weights in the model dtype (Qwen3-MoE casts them; Mixtral multiplies in fp32, which
    equals this in fp32 and may differ in a bf16 last bit: fused_moe's contract is the
    model dtype)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = _parameter((num_experts, hidden), (num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] in x's dtype, topk_ids [T, k])."""
        return ops.router_topk(ops.linear(x, self.weight, None), None, self.top_k,
                               sigmoid=False, renormalize=self.renormalize, eps=0.0, scale=1.0,
                               dtype=x.dtype)


class Experts(nn.Module):
    """This rank's experts, as fused_moe takes them: gate_up_proj [E_local, 2 I_local, H]
    (gate rows first) and down_proj [E_local, H, I_local] (module docstring: which)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int,
                 expert_parallel: bool):
        super().__init__()
        tp = get_tp()
        # ValueErrors here are distributed.check_tp's, raised earlier with the whole story.
        if expert_parallel:
            self.num_local, self.inter_local = num_experts // tp.size, intermediate
            self.first_expert, self.inter_start = tp.rank * self.num_local, 0
        else:
            self.num_local, self.inter_local = num_experts, intermediate // tp.size
            self.first_expert, self.inter_start = 0, tp.rank * self.inter_local
        self.num_experts, self.intermediate = num_experts, intermediate
        e, i = self.num_local, self.inter_local
        self.gate_up_proj = _parameter((e, 2 * i, hidden), (num_experts, 2 * intermediate, hidden),
                                       self.weight_loader)
        self.down_proj = _parameter((e, hidden, i), (num_experts, hidden, intermediate),
                                    self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard: tuple[int, str] | None = None) -> None:
        """Copy this rank's part of a fused tensor (shard None: [E, 2I, H] or [E, H, I]) or of
        one expert's gate, up or down projection (shard (expert, part)); an expert another
        rank holds is skipped."""
        if shard is None:
            _check_fits(param, loaded, param.full_shape)
            local = loaded.narrow(0, self.first_expert, self.num_local)
            for e in range(self.num_local):
                if param is self.gate_up_proj:
                    gate, up = local[e].chunk(2, dim=0)
                    self._load_rows(param[e], gate, 0)
                    self._load_rows(param[e], up, self.inter_local)
                else:
                    self._load_down(param[e], local[e])
            return
        expert, part = shard
        e = expert - self.first_expert
        if not 0 <= e < self.num_local:
            return
        if part == "down":
            self._load_down(param[e], loaded)
        else:
            self._load_rows(param[e], loaded, 0 if part == "gate" else self.inter_local)

    def _load_rows(self, dest: torch.Tensor, loaded: torch.Tensor, offset: int) -> None:
        """One expert's gate or up [I, H]: this rank's rows, at `offset` in its [2 I_local, H]."""
        _check_fits(dest, loaded, (self.intermediate, dest.shape[1]))
        dest.narrow(0, offset, self.inter_local).copy_(
            loaded.narrow(0, self.inter_start, self.inter_local))

    def _load_down(self, dest: torch.Tensor, loaded: torch.Tensor) -> None:
        """One expert's down [H, I]: this rank's columns."""
        _check_fits(dest, loaded, (dest.shape[0], self.intermediate))
        dest.copy_(loaded.narrow(1, self.inter_start, self.inter_local))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             self.first_expert)


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: x [T, hidden] -> this rank's partial sum [T, hidden] (the
    next RMSNorm sums the ranks'; at tp = 1 it is the whole output)."""

    def __init__(self, cfg: ModelConfig, expert_parallel: bool = False,
                 gate: nn.Module | None = None):
        """`gate` another router (x -> (topk_weights, topk_ids)), e.g. DeepSeek's grouped one;
        Router by default."""
        super().__init__()
        self.gate = gate or Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                   cfg.norm_topk_prob)
        self.experts = Experts(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                               expert_parallel)
        # [E + 1] int64 when counting (module docstring): routed[e] the forwards in which some
        # token chose global expert e, routed[E] the forwards. Not a weight: not saved.
        counting = os.environ.get(COUNT_ROUTED) == "1"
        self.register_buffer("routed", torch.zeros(cfg.num_experts + 1, dtype=torch.int64)
                             if counting else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        if self.routed is not None:
            self._count(topk_ids)
        return self.experts(x, topk_weights, topk_ids)

    def _count(self, topk_ids: torch.Tensor) -> None:
        """On the device, no host sync (CUDA graphs capture it): one more forward, and one
        more for each expert some token chose (the padding rows of a graph's batch too)."""
        hit = torch.zeros_like(self.routed)
        hit.index_fill_(0, topk_ids.flatten(), 1)
        hit[-1:].fill_(1)                # fill_, not a copy from the host (graph capture)
        self.routed += hit


def routed_counts(model: nn.Module) -> torch.Tensor | None:
    """[sparse layers, E + 1] on the CPU: the counters of the model's SparseMoE layers
    (`SparseMoE.routed`), None when they do not count. Under tensor parallelism every rank
    routes every token alike (the router is replicated), so one rank's counters see all."""
    counters = [m.routed for m in model.modules()
                if isinstance(m, SparseMoE) and m.routed is not None]
    return torch.stack(counters).cpu() if counters else None
