"""The `args` contract of the Ray Serve application (`configs/pd.yaml`, the Helm chart).

One tree: `engine:` is pd_cluster's EngineConfig (what every engine replica runs with), beside
it the application's own fields (replicas, transport, limits, routing...). Every field is
declared once, with its type, bounds, default and description, in the pydantic models below.

`router.app:build_app(args)` calls `AppConfig.from_args(args)`: unknown keys and bad values are
refused with a `ValueError` that names the field (`limits.max_queue: ...`,
`engine.block_size: ...`). Then `replica_actor_options(config, role, ray.cluster_resources())`
gives each engine replica its Ray actor options, and `config.router_deployment_options()` the
router deployment's replica count or Serve autoscaling. `planner:` configures the elastic P:D
planner: `config.planner_settings()` is its policy's PlannerSettings, and `most_replicas(role)`
/ `most_engine_replicas()` how many engine replicas may exist at once, planner or not. This
module imports neither Ray nor torch, so it is cheap to test. The sections with no say in
the others (kv_pool, kv_tiers, limits, routing, router autoscaling, planner) are declared in
router/app_sections.py.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from pd_cluster.config import STRICT_MODEL_CONFIG, EngineConfig
from pd_cluster.config_errors import validate_config
from pd_cluster.planner import PlannerSettings
from pd_cluster.role import Role
from router.app_sections import (ROUTING_POLICIES, KVPoolConfig,  # noqa: F401
                                 KVTiersConfig, Limits, PlannerConfig, RouterAutoscaling,
                                 Routing)
from router.app_sections import TenantConfig, TracingConfig

AUTO = "auto"
# Share of its role's custom resource (named by the Role's value) that one replica asks for. A
# node group advertises one unit per GPU, so this only pins the replica to its group; GPUs (or
# CPUs) limit packing.
ROLE_RESOURCE_SHARE = 0.01
MIN_CPU_SHARE = 0.01        # the least CPU share an auto replica gets on a crowded machine
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ReplicaResources(BaseModel):
    """Explicit Ray resources of one engine replica, used instead of "auto"."""

    model_config = STRICT_MODEL_CONFIG

    num_gpus: float = Field(0.0, ge=0, description="GPUs of the replica")
    num_cpus: float = Field(1.0, ge=0, description="CPUs of the replica")
    resources: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description='custom Ray resources, e.g. {"prefill": 0.01}')

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


def _resources_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return AUTO if value == AUTO else None
    return "explicit" if isinstance(value, (Mapping, ReplicaResources)) else None


# "auto", or a mapping of ReplicaResources; anything else gets one error saying so.
Resources = Annotated[
    Annotated[Literal["auto"], Tag(AUTO)] | Annotated[ReplicaResources, Tag("explicit")],
    Discriminator(_resources_kind, custom_error_type="resources",
                  custom_error_message='expected "auto" or a mapping of num_gpus, num_cpus, '
                                       "resources")]


class AppConfig(BaseModel):
    """The application's `args`, validated. Defaults run on a laptop's CPU with the bundled model."""

    model_config = STRICT_MODEL_CONFIG

    engine: EngineConfig = Field(default_factory=EngineConfig, description=(
        "what every engine replica runs with (pd_cluster.config.EngineConfig)"))
    mode: Literal["disaggregated", "pooled", "colocated"] = Field("disaggregated", description=(
        "disaggregated: P prefills and pushes KV to D | pooled: KV through a "
        "DistributedKVCache | colocated: one engine does both"))
    num_prefill: int = Field(1, ge=0, description=(
        "prefill replicas; 0 (and the default) in colocated mode"))
    num_decode: int = Field(1, ge=1, description="decode replicas (the engines, in colocated mode)")
    prefill_resources: Resources = Field(AUTO, description=(
        '"auto" (see replica_actor_options) or explicit Ray resources'))
    decode_resources: Resources = Field(AUTO, description=(
        '"auto" (see replica_actor_options) or explicit Ray resources'))
    prefill_tensor_parallel_size: int | None = Field(None, ge=1, le=64, description=(
        "GPUs (tensor-parallel ranks) of each prefill replica; null: "
        "engine.tensor_parallel_size"))
    decode_tensor_parallel_size: int | None = Field(None, ge=1, le=64, description=(
        "GPUs (tensor-parallel ranks) of each decode replica (colocated: each engine); null: "
        "engine.tensor_parallel_size"))
    transport: Literal["nixl", "ucx", "ray", "local"] = Field("nixl", description=(
        "KV transport between P and D (pooled: and the pool)"))
    # 0 keeps every prompt on P, so disaggregated output stays comparable token for token with
    # colocated output; Dynamo's max_local_prefill_length of 1000 suits GPUs as a start.
    conditional_disagg_threshold: int = Field(0, ge=0, description=(
        "a prompt with fewer uncached tokens than this is prefilled on its decode replica; "
        "0: never"))
    prefill_failure_policy: Literal["recompute", "fail"] = Field("recompute", description=(
        "a prefill failed: its decode replica prefills itself, or the request fails"))
    limits: Limits = Field(default_factory=Limits, description="what the router refuses")
    api_key_env: str | None = Field(None, description=(
        "environment variable holding the API key; null: no auth (or `tenants`)"))
    tenants: list[TenantConfig] = Field(default_factory=list, description=(
        "API keys of tenants, each with its own prefix-cache salt and rate limits "
        "(router/tenants.py); instead of api_key_env"))
    routing: Routing = Field(default_factory=Routing, description="how replicas are picked")
    router_replicas: int = Field(1, ge=1, description=(
        "replicas of the router deployment (OpenAIRouter); leave at 1 with router_autoscaling"))
    router_autoscaling: RouterAutoscaling | None = Field(None, description=(
        "Serve autoscaling of the router deployment instead of router_replicas; null: a fixed "
        "count"))
    kv_pool: KVPoolConfig = Field(default_factory=KVPoolConfig, description=(
        "the KV pool of pooled mode: capacity, placement, the same-node fast path"))
    kv_tiers: KVTiersConfig = Field(default_factory=KVTiersConfig, description=(
        "the KV cache hierarchy: evicted prefix blocks kept in host memory and on disk, "
        "loaded back instead of recomputed (off by default)"))
    planner: PlannerConfig = Field(default_factory=PlannerConfig, description=(
        "the elastic P:D planner, which resizes and flips the tiers to meet TTFT / TPOT SLOs "
        "within a GPU budget (off by default)"))
    tracing: TracingConfig = Field(default_factory=TracingConfig, description=(
        "OpenTelemetry traces of requests: an OTLP/HTTP endpoint and / or a span file, the "
        "sampling ratio (off by default)"))

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """Validate the `args` of the Serve application; ValueError names the bad field."""
        return validate_config(cls, {} if args is None else args, "args")

    @model_validator(mode="before")
    @classmethod
    def _colocated_default(cls, args: Any) -> Any:
        if isinstance(args, Mapping) and args.get("mode") == "colocated":
            return {"num_prefill": 0, **args}
        return args

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise ValueError("is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        if self.mode == "colocated" and self.num_prefill != 0:
            raise ValueError("num_prefill: must be 0 in colocated mode (decode replicas prefill)")
        if self.mode != "colocated" and self.num_prefill < 1:
            raise ValueError(f"num_prefill: {self.mode} mode needs at least 1 prefill replica "
                             "(0 only with mode: colocated)")
        for role in Role:
            tp, spec = self.tensor_parallel_size(role), getattr(self, f"{role}_resources")
            if tp > 1 and isinstance(spec, ReplicaResources) and 0 < spec.num_gpus < tp:
                raise ValueError(f"{role}_resources.num_gpus: {spec.num_gpus:g} for "
                                 f"{self._tp_field(role)} {tp}: each rank needs a GPU")
            if tp > 1 and self.engine.speculative is not None:
                raise ValueError(f"engine.speculative: not supported with "
                                 f"{self._tp_field(role)} {tp} yet (one rank only)")
        if self.router_autoscaling is not None and self.router_replicas != 1:
            raise ValueError(
                f"router_replicas: {self.router_replicas} with router_autoscaling set; leave "
                "router_replicas at 1, Serve then keeps the router between "
                "router_autoscaling.min_replicas and max_replicas")
        longest = self.engine.max_model_len
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self.limits, name)
            if longest is not None and value is not None and value > longest:
                raise ValueError(f"limits.{name}: {value} exceeds engine.max_model_len {longest}")
        if self.planner.enabled:
            self._check_planner()
        if self.tenants:
            self._check_tenants()
        if self.kv_tiers.enabled:
            self._check_kv_tiers()
        return self

    def _check_tenants(self) -> None:
        if self.api_key_env is not None:
            raise ValueError("tenants: set api_key_env or tenants, not both (a tenant has its "
                             "own key)")
        for field in ("name", "api_key_env"):
            values = [getattr(t, field) for t in self.tenants]
            if len(set(values)) < len(values):
                raise ValueError(f"tenants: two tenants have the same {field}")
        if self.router_autoscaling is not None and any(
                t.requests_per_s or t.tokens_per_s for t in self.tenants):
            raise ValueError("tenants: rate limits are shared among a fixed count of router "
                             "replicas (router_replicas), not with router_autoscaling")

    def _check_kv_tiers(self) -> None:
        # The tiers keep and find blocks by prefix hash, which only the prefix cache gives
        # them; an engine copies to and from its node's host tier in its own process, which
        # needs its whole KV cache there (one tensor-parallel rank).
        if not self.engine.enable_prefix_caching:
            raise ValueError("kv_tiers.enabled: needs engine.enable_prefix_caching (the tiers "
                             "keep blocks by prefix hash)")
        for role in Role:
            tp = self.tensor_parallel_size(role)
            if tp > 1 and (role is Role.DECODE or self.mode != "colocated"):
                raise ValueError(f"kv_tiers.enabled: not supported with {self._tp_field(role)} "
                                 f"{tp} yet (an engine's KV cache must be one shard)")

    def _check_planner(self) -> None:
        planner = self.planner
        if self.mode == "colocated":
            raise ValueError("planner: needs disaggregated or pooled mode (mode is colocated: "
                             "no prefill tier to resize)")
        tps = {role: self.tensor_parallel_size(role) for role in Role}
        if tps[Role.PREFILL] != tps[Role.DECODE]:
            raise ValueError(
                f"planner: needs one tensor-parallel size for both roles (a flip keeps the "
                f"engine's weights, sharded one way); {self._tp_field(Role.PREFILL)} is "
                f"{tps[Role.PREFILL]}, {self._tp_field(Role.DECODE)} {tps[Role.DECODE]}")
        for role in Role:
            least, most = getattr(planner, f"min_{role}"), getattr(planner, f"max_{role}")
            if most < least:
                raise ValueError(f"planner.max_{role}: {most} is below planner.min_{role} "
                                 f"{least}")
        for role in Role:
            least, most = getattr(planner, f"min_{role}"), getattr(planner, f"max_{role}")
            count = getattr(self, f"num_{role}")
            if not least <= count <= most:
                raise ValueError(f"num_{role}: {count} is outside planner.min_{role}.."
                                 f"max_{role} ({least}..{most})")
        start = self._starting_gpus()
        if planner.gpu_budget is not None and planner.gpu_budget < start:
            raise ValueError(
                f"planner.gpu_budget: {planner.gpu_budget} is below the {start} GPUs the tiers "
                f"start with ({self.num_prefill} prefill + {self.num_decode} decode replicas "
                f"x tensor-parallel size {tps[Role.DECODE]})")

    def tensor_parallel_size(self, role: Role) -> int:
        """Tensor-parallel ranks (GPUs) of each `role` replica."""
        own = getattr(self, f"{role}_tensor_parallel_size")
        return self.engine.tensor_parallel_size if own is None else own

    def _tp_field(self, role: Role) -> str:
        own = f"{role}_tensor_parallel_size"
        return own if getattr(self, own) is not None else "engine.tensor_parallel_size"

    def role_engine(self, engine: EngineConfig, role: Role) -> EngineConfig:
        """`engine` (the resolved engine config) as a `role` replica runs it."""
        tp = self.tensor_parallel_size(role)
        if tp == engine.tensor_parallel_size:
            return engine
        return engine.model_copy(update={"tensor_parallel_size": tp})

    @property
    def router_max_replicas(self) -> int:
        """The most router replicas this config can run (autoscaling's max_replicas)."""
        scaling = self.router_autoscaling
        return self.router_replicas if scaling is None else scaling.max_replicas

    def _starting_gpus(self) -> int:
        return sum(getattr(self, f"num_{role}") * self.tensor_parallel_size(role)
                   for role in Role)

    def planner_gpu_budget(self) -> int:
        """GPUs the two tiers may use together: planner.gpu_budget, or (null) what num_prefill
        and num_decode start with (replicas x tensor-parallel size)."""
        budget = self.planner.gpu_budget
        return self._starting_gpus() if budget is None else budget

    def _budget_replicas(self) -> int:
        # With the planner on, both roles have one tensor-parallel size (checked above).
        return self.planner_gpu_budget() // self.tensor_parallel_size(Role.DECODE)

    def most_replicas(self, role: Role) -> int:
        """The most `role` replicas that can exist at once: num_prefill / num_decode, or with
        the planner on, as many as it may grow the role's tier to: max_<role>, and no more
        than the budget leaves once the other tier is at its minimum."""
        role = Role.parse(role)
        if not self.planner.enabled:
            return getattr(self, f"num_{role}")
        return min(getattr(self.planner, f"max_{role}"),
                   self._budget_replicas() - getattr(self.planner, f"min_{role.other}"))

    def most_engine_replicas(self) -> int:
        """The most engine replicas (both roles) that can exist at once: num_prefill +
        num_decode, or with the planner on, as many as the GPU budget holds."""
        if not self.planner.enabled:
            return self.num_prefill + self.num_decode
        return self._budget_replicas()

    def planner_settings(self) -> PlannerSettings:
        """The planner's policy settings (pd_cluster.planner.PlannerSettings) of this config:
        SLOs in seconds, the resolved GPU budget, GPUs per instance = the tensor-parallel
        size. For a config with the planner enabled (whose checks it then passed)."""
        p = self.planner
        return PlannerSettings(
            ttft_s=p.ttft_ms / 1000, tpot_s=p.tpot_ms / 1000,
            gpu_budget=self.planner_gpu_budget(),
            min_prefill=p.min_prefill, max_prefill=p.max_prefill,
            min_decode=p.min_decode, max_decode=p.max_decode,
            cooldown_s=p.cooldown_s, headroom=p.headroom, calm_intervals=p.calm_intervals,
            gpus_per_instance=self.tensor_parallel_size(Role.DECODE))

    def router_deployment_options(self) -> dict[str, Any]:
        """Ray Serve `.options(...)` kwargs of the router deployment: `num_replicas`, or
        `autoscaling_config` (Serve refuses both together)."""
        if self.router_autoscaling is None:
            return {"num_replicas": self.router_replicas}
        return {"autoscaling_config": self.router_autoscaling.model_dump()}


def replica_actor_options(config: AppConfig, role: Role,
                          cluster_resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options of one `role` replica.

    Explicit resources are returned as written. "auto" asks for one GPU per tensor-parallel
    rank (`tensor_parallel_size(role)`) when the cluster has GPUs, else a share of the CPUs that leaves one for each router replica (see _cpu_share);
    and, when the cluster offers the custom resource named after the role (a node group of
    `configs/cluster.yaml` or the Helm chart), ROLE_RESOURCE_SHARE of it, which pins the
    replica to its group. In colocated mode the engines are DECODE replicas.
    `cluster_resources` is `ray.cluster_resources()`.
    """
    role = Role.parse(role)
    spec = getattr(config, f"{role}_resources")
    if isinstance(spec, ReplicaResources):
        return spec.actor_options()
    if cluster_resources.get("GPU", 0) >= 1:
        # One GPU per tensor-parallel rank, all on one node: Ray places an actor on one node.
        options: dict[str, Any] = {"num_cpus": 1.0,
                                   "num_gpus": float(config.tensor_parallel_size(role))}
    else:
        options = {"num_cpus": _cpu_share(config, cluster_resources.get("CPU", 1.0)),
                   "num_gpus": 0.0}
    if cluster_resources.get(role, 0) > 0:
        options["resources"] = {str(role): ROLE_RESOURCE_SHARE}
    return options


def _cpu_share(config: AppConfig, cpus: float) -> float:
    """CPUs for each engine replica on a GPU-less cluster, at most one. The engines share what
    the router replicas leave (one CPU each, router.app's router_cpus; autoscaling's
    max_replicas of them), but at least one CPU, or half of a smaller machine. Shared among
    the most engine replicas that can exist at once: those the planner may add must fit too."""
    spare = max(cpus - config.router_max_replicas, min(1.0, cpus / 2))
    share = math.floor(100 * spare / config.most_engine_replicas()) / 100
    return min(1.0, max(MIN_CPU_SHARE, share))
