"""Sections of the application's `args` (router/app_config.py's AppConfig) that stand on their
own: the KV pool, the KV cache tiers, the router's limits and routing, the router deployment's autoscaling, and the
elastic P:D planner. Each field is declared once, with its type, bounds, default and description.
"""
from __future__ import annotations

import typing
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from pd_cluster.config import STRICT_MODEL_CONFIG

RoutingPolicy = Literal["kv_aware", "round_robin"]
# The router's policy registry must know every name listed here.
ROUTING_POLICIES: tuple[str, ...] = typing.get_args(RoutingPolicy)


class KVPoolConfig(BaseModel):
    """The KV pool of pooled mode (actors/kv_pool.py): its size, where it runs, how long it
    keeps a prompt's blocks for its decoder."""

    model_config = STRICT_MODEL_CONFIG

    capacity_blocks: int | None = Field(None, ge=1, description=(
        "KV blocks each pool holds; null: capacity_bytes, or as many as an engine's KV cache"))
    capacity_bytes: int | None = Field(None, ge=1, description=(
        "host memory of each pool in bytes (whole blocks of the engines' layout); null: "
        "capacity_blocks"))
    placement: Literal["single", "per_node"] = Field("single", description=(
        "single: one pool for the cluster | per_node: one on every node, engines put into "
        "their node's and read from any"))
    shared_memory: bool = Field(True, description=(
        "engines on a pool's node copy KV to and from its memory directly (a shared-memory "
        "segment: host-memory speed); false: always through the transport"))
    hold_s: float = Field(60.0, gt=0, description=(
        "how long the pool keeps a prompt's blocks for its decoder if nobody releases them"))

    @model_validator(mode="after")
    def _one_capacity(self) -> KVPoolConfig:
        if self.capacity_blocks is not None and self.capacity_bytes is not None:
            raise ValueError("set capacity_blocks or capacity_bytes, not both")
        return self


class KVTiersConfig(BaseModel):
    """The KV cache hierarchy below each engine's GPU cache (docs/kv_tiers.md): prefix blocks an
    engine evicts go to its node's host-memory tier (a per-node KV pool in shared memory, in
    every mode) and from there to a disk tier; a prefix found there is loaded back instead of
    recomputed when loading costs less than prefilling it."""

    model_config = STRICT_MODEL_CONFIG

    enabled: bool = Field(False, description=(
        "keep evicted prefix blocks in host memory (and on disk with disk_path) and load them "
        "back; false: an evicted block is gone"))
    host_bytes: int = Field(4 * 2**30, ge=1, description=(
        "host memory of each node's host tier in bytes (whole blocks of the engines' layout; "
        "at least one block)"))
    disk_path: str | None = Field(None, min_length=1, description=(
        "directory of each node's disk tier (created if missing; one subdirectory per node); "
        "null: no disk tier"))
    disk_bytes: int = Field(64 * 2**30, ge=1, description=(
        "bytes of block files each node's disk tier keeps (least recently used removed first)"))
    host_gbps: float = Field(8.0, gt=0, description=(
        "bandwidth (GB/s) the cost rule assumes for a host-tier load until it has measured one"))
    disk_gbps: float = Field(1.0, gt=0, description=(
        "bandwidth (GB/s) the cost rule assumes for a disk-tier load until it has measured one"))
    prefill_tokens_per_s: float | None = Field(None, gt=0, description=(
        "prefill rate the cost rule compares a load with; null: measured from the engine's "
        "own prefill steps"))
    min_load_tokens: int = Field(0, ge=0, description=(
        "a cached prefix shorter than this is always recomputed"))

    @field_validator("disk_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        # A relative path would resolve against each pool actor's working directory, which
        # Ray chooses; the same absolute path on every node says where the files go.
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path (each node's disk tier "
                             "lives under it)")
        return value


class Limits(BaseModel):
    """What the router refuses or cuts short, so that overload is answered instead of queued."""

    model_config = STRICT_MODEL_CONFIG

    max_tokens: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_prompt_tokens: int | None = Field(None, ge=1, description=(
        "longest prompt in tokens; null: max_model_len - 1"))
    max_queue: int = Field(256, ge=0, description=(
        "waiting requests before the router answers 429"))
    request_timeout_s: float = Field(600.0, gt=0, description=(
        "a request running longer is aborted (504)"))
    max_migrations: int = Field(3, ge=0, description=(
        "times a stream may move to another decode replica when its own dies; the next "
        "death fails it (503)"))


class Routing(BaseModel):
    """How the router scores candidates: Dynamo's `w × blocks to prefill + active decode blocks`."""

    model_config = STRICT_MODEL_CONFIG

    policy: RoutingPolicy = Field("kv_aware", description="kv_aware | round_robin")
    prefill_weight: float = Field(1.0, ge=0, description=(
        "Dynamo's overlap weight w: weight of the prompt blocks a P still has to compute"))


class RouterAutoscaling(BaseModel):
    """Ray Serve's `autoscaling_config` of the router deployment, the keys that matter for it.

    Serve keeps between min_replicas and max_replicas router replicas, each at about
    target_ongoing_requests requests in flight. Serve's other keys keep their defaults.
    """

    model_config = STRICT_MODEL_CONFIG

    # Serve allows 0 (scale to zero); the router is the only ingress, so the first request
    # after a quiet spell would wait for a replica to start: at least one stays up.
    min_replicas: int = Field(1, ge=1, description="fewest router replicas")
    # No default: Serve's is 1, which would not scale at all.
    max_replicas: int = Field(ge=1, description="most router replicas")
    initial_replicas: int | None = Field(None, ge=1, description=(
        "router replicas when the application is deployed; null: min_replicas"))
    # A router replica streams many requests at once (its Serve max_ongoing_requests is in
    # the hundreds), so Serve's default of 2 would scale to max_replicas under any load. 64 is
    # not a measured saturation point: lower it when the router's CPU saturates (TTFT and
    # inter-token latency rise while the engines have room).
    target_ongoing_requests: float = Field(64.0, gt=0, description=(
        "requests in flight (streams included) per router replica that Serve scales toward"))
    upscale_delay_s: float = Field(30.0, ge=0, description=(
        "seconds the load must stay above target before a replica is added (Serve's default)"))
    downscale_delay_s: float = Field(600.0, ge=0, description=(
        "seconds the load must stay below target before a replica is removed (Serve's default)"))

    @field_validator("max_replicas")
    @classmethod
    def _max_not_below_min(cls, value: int, info: ValidationInfo) -> int:
        least = info.data.get("min_replicas")
        if least is not None and value < least:
            raise ValueError(f"must be at least min_replicas ({least})")
        return value

    @field_validator("initial_replicas")
    @classmethod
    def _initial_within_bounds(cls, value: int | None, info: ValidationInfo) -> int | None:
        least, most = info.data.get("min_replicas"), info.data.get("max_replicas")
        if value is not None and least is not None and most is not None \
                and not least <= value <= most:
            raise ValueError(f"must be within min_replicas..max_replicas ({least}..{most})")
        return value


class PlannerConfig(BaseModel):
    """The elastic P:D planner (pd_cluster/planner.py): every `interval_s` the engine controller
    measures TTFT and TPOT at `percentile` and adds, removes or flips one engine replica so
    that both meet their SLOs within `gpu_budget`. GPUs count replicas x tensor-parallel size.
    """

    model_config = STRICT_MODEL_CONFIG

    enabled: bool = Field(False, description=(
        "let the planner resize the prefill and decode tiers; false: num_prefill and "
        "num_decode stay as written"))
    ttft_ms: float = Field(1000.0, gt=0, description="TTFT SLO (ms) at the percentile")
    tpot_ms: float = Field(50.0, gt=0, description=(
        "TPOT SLO (ms) at the percentile: mean time per output token after the first"))
    percentile: float = Field(90.0, gt=0, le=100, description=(
        "percentile of the interval's requests the SLOs hold for"))
    gpu_budget: int | None = Field(None, ge=1, description=(
        "GPUs the two tiers may use together (replicas x tensor_parallel_size); null: what "
        "num_prefill and num_decode start with"))
    min_prefill: int = Field(1, ge=1, description="fewest prefill replicas")
    max_prefill: int = Field(8, ge=1, description="most prefill replicas")
    min_decode: int = Field(1, ge=1, description="fewest decode replicas")
    max_decode: int = Field(8, ge=1, description="most decode replicas")
    interval_s: float = Field(30.0, gt=0, description=(
        "seconds between two decisions (the interval measured)"))
    cooldown_s: float = Field(120.0, ge=0, description=(
        "seconds after a change before the next one (a new engine loads, its effect shows)"))
    calm_intervals: int = Field(3, ge=1, description=(
        "intervals in a row well within both SLOs before a replica is removed"))
    headroom: float = Field(0.5, gt=0, lt=1, description=(
        "a tier under headroom x its SLO has room to give (a removal, a flip)"))
    drain_timeout_s: float = Field(600.0, gt=0, description=(
        "longest wait for a removed or flipped replica to finish its requests"))
    profile: str | None = Field(None, min_length=1, description=(
        "a `pd-cluster profile` JSON file (path on the controller's node): removals are "
        "vetted by predicting the smaller tiers on the interval's load; null: not vetted"))


class TracingConfig(BaseModel):
    """OpenTelemetry traces of requests (router/tracing.py): one trace per HTTP request, its
    spans built in the router from the router's and the engine actors' own stamps. Off by
    default, and then free: no span object is made and no per-token work is done."""

    model_config = STRICT_MODEL_CONFIG

    enabled: bool = Field(False, description=(
        "trace requests; false: no tracing work at all"))
    endpoint: str | None = Field(None, min_length=1, description=(
        "OTLP/HTTP traces URL of a collector (Jaeger, Tempo, the OpenTelemetry Collector), "
        "e.g. http://otel-collector:4318/v1/traces; null: none"))
    file: str | None = Field(None, min_length=1, description=(
        "absolute path on each router replica's node to append finished spans to, one JSON "
        "object a line, for `pd-cluster trace` (Perfetto / Chrome trace JSON); null: none"))
    sampling_ratio: float = Field(1.0, ge=0, le=1, description=(
        "share of requests traced that come without a sampled W3C traceparent (a client's "
        "sampled traceparent is always honoured)"))
    service_name: str = Field("pd-cluster", min_length=1, description=(
        "the traces' service.name"))

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} must be an http:// or https:// URL (OTLP over HTTP)")
        return value

    @field_validator("file")
    @classmethod
    def _absolute_file(cls, value: str | None) -> str | None:
        # A relative path would resolve against the router replica's working directory,
        # which Ray chooses.
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path")
        return value

    @model_validator(mode="after")
    def _somewhere(self) -> TracingConfig:
        if self.enabled and self.endpoint is None and self.file is None:
            raise ValueError("enabled needs an endpoint or a file to send the spans to")
        return self


class TenantConfig(BaseModel):
    """One tenant (router/tenants.py): its API key, prefix-cache salt and rate limits."""

    model_config = STRICT_MODEL_CONFIG

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$", description=(
        "the tenant's name (in 429 messages and as its default cache salt)"))
    api_key_env: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description=(
        "environment variable holding the tenant's API key"))
    cache_salt: str | None = Field(None, min_length=1, description=(
        "salt of the tenant's prefix-cache entries; null: the name. Tenants with different "
        "salts never share cached KV"))
    requests_per_s: float | None = Field(None, gt=0, description=(
        "requests a second the tenant may send, over all router replicas; null: no limit"))
    tokens_per_s: float | None = Field(None, gt=0, description=(
        "prompt tokens + max_tokens a second, over all router replicas; null: no limit"))

