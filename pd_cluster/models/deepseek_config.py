"""What a DeepSeek-V2/V3 config.json adds to the Llama-family shape (`pd_cluster.config.
ModelConfig`): multi-head latent attention (`MLAConfig`) and DeepSeek's grouped expert routing
(`GroupedRouting`). Torch-free, so the config imports without it.

How the rest of ModelConfig reads for these models: the KV cache is latent, one entry per
token and layer of kv_lora_rank + qk_rope_head_dim values, so `num_kv_heads` is 1 and
`head_dim` that width (pd_cluster/kv_layout.py: `latent`); the first `first_k_dense_replace`
layers, and those off `moe_layer_freq`, are dense (`mlp_only_layers`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# topk_method -> how the router scores experts (softmax or sigmoid).
ROUTING_METHODS = {"greedy": "softmax", "group_limited_greedy": "softmax", "noaux_tc": "sigmoid"}


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention's widths. Per head the query is qk_nope_head_dim values
    that meet the latent (through kv_b_proj) and qk_rope_head_dim rotated ones that meet the
    shared RoPE key; values are v_head_dim wide. q_lora_rank None: q_proj straight from the
    hidden state (V2-Lite); else through q_a_proj, a norm and q_b_proj."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # RoPE on interleaved pairs (x0, x1), (x2, x3) (V2, and V3's rope_interleave), else on
    # the two halves (neox style).
    rope_interleave: bool = True
    # The softmax scale's YaRN factor, squared in `softmax_scale` (DeepSeek's mscale_all_dim).
    mscale: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values one token's cache entry holds per layer: the latent c, then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.mscale * self.mscale


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """DeepSeek's router. `method` (config topk_method): "greedy" (softmax, top-k),
    "group_limited_greedy" (softmax; only the topk_group groups of n_group with the best
    single expert compete), "noaux_tc" (sigmoid plus e_score_correction_bias for choosing;
    groups ranked by their top two). Weights: the chosen experts' scores, renormalised when
    norm_topk_prob (ModelConfig's), times routed_scaling_factor. n_shared_experts always-on
    experts of moe_intermediate_size each run beside the routed ones."""

    method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int

    @property
    def scoring(self) -> str:
        return ROUTING_METHODS[self.method]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (DeepSeek's yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields of a DeepSeek config.json that differ from the Llama family's
    reading (attention, cache shape, experts); ValueError for what we cannot serve."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mscale = 1.0
    if rope_type != "default" and rope.get("mscale_all_dim"):
        mscale = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
    mla = MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    rope_interleave=arch == "DeepseekV2ForCausalLM"
                    or bool(cfg.get("rope_interleave", True)), mscale=mscale)
    fields: dict[str, Any] = dict(mla=mla, num_kv_heads=1, head_dim=mla.cache_width,
                                  qkv_bias=bool(cfg.get("attention_bias", False)))
    experts = cfg.get("n_routed_experts")
    if not experts:
        return fields
    method = cfg.get("topk_method") or ("noaux_tc" if arch == "DeepseekV3ForCausalLM"
                                        else "greedy")
    if method not in ROUTING_METHODS:
        raise ValueError(f"{arch}: topk_method {method!r} is not supported; supported: "
                         f"{', '.join(ROUTING_METHODS)}")
    scoring = cfg.get("scoring_func", ROUTING_METHODS[method])
    if scoring != ROUTING_METHODS[method]:
        raise ValueError(f"{arch}: scoring_func {scoring!r} with topk_method {method!r} is not "
                         f"supported ({method} scores with {ROUTING_METHODS[method]})")
    groups = cfg.get("n_group") or 1
    routing = GroupedRouting(method=method, n_group=groups,
                             topk_group=cfg.get("topk_group") or groups,
                             routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                             n_shared_experts=cfg.get("n_shared_experts") or 0)
    if experts % groups or routing.topk_group > groups:
        raise ValueError(f"{arch}: {experts} experts do not form n_group {groups} groups with "
                         f"topk_group {routing.topk_group} of them chosen")
    first_dense, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i < first_dense or i % freq)
    return dict(fields, routing=routing, num_experts=experts,
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), decoder_sparse_step=1,
                mlp_only_layers=dense)
