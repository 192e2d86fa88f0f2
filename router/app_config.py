"""The `args` contract of the Ray Serve application (`configs/pd.yaml`, the Helm chart).

`router.app:build_app(args)` calls `AppConfig.from_args(args)`: unknown keys and bad values are
refused with a `ValueError` that names the field (`limits.max_queue: ...`). Then
`replica_actor_options(config, role, ray.cluster_resources())` gives each engine replica its
Ray actor options. This module imports neither Ray nor torch, so it is cheap to test.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MODES = ("disaggregated", "pooled", "colocated")
TRANSPORTS = ("nixl", "ucx", "ray", "local")
DTYPES = ("auto", "float32", "bfloat16", "float16")
FAILURE_POLICIES = ("recompute", "fail")
LOAD_FORMATS = ("auto", "dummy")
# The router's policy registry must know every name listed here.
ROUTING_POLICIES = ("kv_aware", "round_robin")
# Engine roles; each is also the name of the custom Ray resource its node pool advertises.
ROLES = ("prefill", "decode")
AUTO = "auto"
# Share of its pool's custom resource that one replica asks for. Pools advertise one unit per
# GPU, so this only pins the replica to its pool; GPUs (or CPUs) are what limit packing.
POOL_SHARE = 0.01
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Reader:
    """Reads typed values out of one mapping of args; every error names the field's path."""

    def __init__(self, args: Any, where: str, known: tuple[str, ...]) -> None:
        self.where = where
        if args is None:
            args = {}
        if not isinstance(args, Mapping):
            raise ValueError(f"{where or 'args'}: expected a mapping, got {args!r}")
        unknown = sorted(str(k) for k in args if k not in known)
        if unknown:
            raise ValueError(f"{where or 'args'}: unknown key(s) {', '.join(unknown)}; "
                             f"known keys: {', '.join(known)}")
        self.args = args

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.args.get(key, default)
        if value not in choices:
            raise ValueError(f"{self.name(key)}: {value!r} is not one of {', '.join(choices)}")
        return value

    def string(self, key: str, default: str | None) -> str | None:
        value = self.args.get(key, default)
        if value is None and default is None:       # an optional field left unset
            return None
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{self.name(key)}: expected a non-empty string, got {value!r}")
        return value

    def integer(self, key: str, default: int | None, minimum: int) -> int | None:
        value = self.args.get(key, default)
        if value is None and default is None:       # an optional field left unset
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{self.name(key)}: expected an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = self.args.get(key, default)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < minimum):
            raise ValueError(f"{self.name(key)}: expected a number >= {minimum}, got {value!r}")
        return float(value)


def _keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@dataclass(frozen=True, slots=True)
class ReplicaResources:
    """Explicit Ray resources of one engine replica, used instead of "auto"."""

    num_gpus: float = 0.0
    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)   # custom, e.g. {"prefill": 0.01}

    @classmethod
    def parse(cls, value: Any, where: str) -> ReplicaResources | str:
        if value == AUTO:
            return AUTO
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected \"auto\" or a mapping, got {value!r}")
        reader = _Reader(value, where, _keys(cls))
        given = reader.args.get("resources") or {}
        custom = _Reader(given, f"{where}.resources", tuple(given) if isinstance(given, Mapping)
                         else ())
        return cls(num_gpus=reader.number("num_gpus", 0.0), num_cpus=reader.number("num_cpus", 1.0),
                   resources={str(k): custom.number(k, 0.0) for k in custom.args})

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


@dataclass(slots=True)
class Limits:
    """What the router refuses or cuts short, so that overload is answered instead of queued."""

    max_tokens: int = 4096                  # largest max_tokens a request may ask for
    max_prompt_tokens: int | None = None    # None: max_model_len less one
    max_queue: int = 256                    # waiting requests before the router answers 429
    request_timeout_s: float = 600.0        # a request running longer is aborted

    @classmethod
    def parse(cls, value: Any) -> Limits:
        reader, default = _Reader(value, "limits", _keys(cls)), cls()
        return cls(max_tokens=reader.integer("max_tokens", default.max_tokens, 1),
                   max_prompt_tokens=reader.integer("max_prompt_tokens", None, 1),
                   max_queue=reader.integer("max_queue", default.max_queue, 0),
                   request_timeout_s=reader.number("request_timeout_s",
                                                   default.request_timeout_s, minimum=0.001))


@dataclass(slots=True)
class Routing:
    """How the router scores candidates: Dynamo's `w × blocks to prefill + active decode blocks`."""

    policy: str = "kv_aware"
    prefill_weight: float = 1.0             # w: weight of the prompt blocks a P still has to compute

    @classmethod
    def parse(cls, value: Any) -> Routing:
        reader, default = _Reader(value, "routing", _keys(cls)), cls()
        return cls(policy=reader.choice("policy", ROUTING_POLICIES, default.policy),
                   prefill_weight=reader.number("prefill_weight", default.prefill_weight))


@dataclass(slots=True)
class AppConfig:
    """The application's `args`, validated. Defaults run on a laptop's CPU with the bundled model."""

    model: str = "default"                  # HF directory or id; "default": bundled SmolLM2-135M
    mode: str = "disaggregated"             # | "pooled" (KV via DistributedKVCache) | "colocated"
    num_prefill: int = 1                    # prefill replicas; 0 (and the default) in colocated
    num_decode: int = 1                     # decode replicas (engines, in colocated mode)
    prefill_resources: ReplicaResources | str = AUTO   # "auto": see replica_actor_options
    decode_resources: ReplicaResources | str = AUTO
    transport: str = "nixl"                 # KV transport between P and D (pooled: and the pool)
    block_size: int = 16                    # tokens per KV block; a power of two
    dtype: str = "auto"                     # "auto": the checkpoint's dtype (float32 on CPU)
    max_model_len: int | None = None        # None: the model's context length
    max_num_seqs: int = 256                 # sequences in one engine's running batch
    max_num_batched_tokens: int = 2048      # token budget of one engine step (chunked prefill)
    # Share of a GPU's memory one engine may take (weights, activations, KV), counting only
    # its own (vLLM's meaning): engines that share a GPU each keep to their share.
    gpu_memory_utilization: float = 0.85
    # A prompt with fewer uncached tokens than this is prefilled on its decode replica instead
    # of going through P (conditional disaggregation). 0 turns it off: every prompt uses P,
    # which keeps disaggregated output comparable token for token with colocated output.
    # Dynamo's max_local_prefill_length of 1000 is a good starting point on GPUs.
    conditional_disagg_threshold: int = 0
    prefill_failure_policy: str = "recompute"   # P failed: D prefills itself, or the request fails
    limits: Limits = field(default_factory=Limits)
    api_key_env: str | None = None          # env var holding the API key; None: no auth
    routing: Routing = field(default_factory=Routing)
    load_format: str = "auto"               # "dummy": random weights from the model's config.json

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """Validate the `args` of the Serve application; ValueError names the bad field."""
        r, d = _Reader(args, "", _keys(cls)), cls()
        mode = r.choice("mode", MODES, d.mode)
        config = cls(
            model=r.string("model", d.model), mode=mode,
            num_prefill=r.integer("num_prefill", 0 if mode == "colocated" else 1, 0),
            num_decode=r.integer("num_decode", d.num_decode, 1),
            prefill_resources=ReplicaResources.parse(r.args.get("prefill_resources", AUTO),
                                                     "prefill_resources"),
            decode_resources=ReplicaResources.parse(r.args.get("decode_resources", AUTO),
                                                    "decode_resources"),
            transport=r.choice("transport", TRANSPORTS, d.transport),
            block_size=r.integer("block_size", d.block_size, 1),
            dtype=r.choice("dtype", DTYPES, d.dtype),
            max_model_len=r.integer("max_model_len", None, 1),
            max_num_seqs=r.integer("max_num_seqs", d.max_num_seqs, 1),
            max_num_batched_tokens=r.integer("max_num_batched_tokens",
                                             d.max_num_batched_tokens, 1),
            gpu_memory_utilization=r.number("gpu_memory_utilization",
                                            d.gpu_memory_utilization),
            conditional_disagg_threshold=r.integer("conditional_disagg_threshold", 0, 0),
            prefill_failure_policy=r.choice("prefill_failure_policy", FAILURE_POLICIES,
                                            d.prefill_failure_policy),
            limits=Limits.parse(r.args.get("limits")),
            api_key_env=r.string("api_key_env", None),
            routing=Routing.parse(r.args.get("routing")),
            load_format=r.choice("load_format", LOAD_FORMATS, d.load_format),
        )
        config._check_consistency()
        return config

    def _check_consistency(self) -> None:
        if self.mode == "colocated" and self.num_prefill != 0:
            raise ValueError("num_prefill: must be 0 in colocated mode (decode replicas prefill)")
        if self.mode != "colocated" and self.num_prefill < 1:
            raise ValueError(f"num_prefill: {self.mode} mode needs at least 1 prefill replica "
                             "(0 only with mode: colocated)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization: expected a share in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            raise ValueError(f"api_key_env: {self.api_key_env!r} is not an environment "
                             "variable name")
        if self.max_model_len is not None:
            for name, value in (("limits.max_prompt_tokens", self.limits.max_prompt_tokens),
                                ("limits.max_tokens", self.limits.max_tokens)):
                if value is not None and value > self.max_model_len:
                    raise ValueError(f"{name}: {value} exceeds max_model_len "
                                     f"{self.max_model_len}")


def replica_actor_options(config: AppConfig, role: str,
                          cluster_resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options of one `role` ("prefill" or "decode") replica.

    Explicit resources are returned as written. "auto" asks for one GPU when the cluster has
    GPUs, else a share of the CPUs that leaves one for the router; and, when the cluster
    offers the custom resource named after the role (a node pool of `configs/cluster.yaml` or
    the Helm chart), a sliver of it, which pins the replica to its pool. In colocated mode the
    engines are "decode" replicas. `cluster_resources` is `ray.cluster_resources()`.
    """
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    spec = config.prefill_resources if role == "prefill" else config.decode_resources
    if isinstance(spec, ReplicaResources):
        return spec.actor_options()
    if cluster_resources.get("GPU", 0) >= 1:
        options: dict[str, Any] = {"num_cpus": 1.0, "num_gpus": 1.0}
    else:
        options = {"num_cpus": _cpu_share(config, cluster_resources.get("CPU", 1.0)),
                   "num_gpus": 0.0}
    if cluster_resources.get(role, 0) > 0:
        options["resources"] = {role: POOL_SHARE}
    return options


def _cpu_share(config: AppConfig, cpus: float) -> float:
    """CPUs for each engine replica on a GPU-less cluster, at most one, keeping one for the router."""
    spare = cpus - 1 if cpus >= 2 else cpus / 2
    share = math.floor(100 * spare / (config.num_prefill + config.num_decode)) / 100
    return min(1.0, max(POOL_SHARE, share))
