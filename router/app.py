"""The Ray Serve application: `import_path: router.app:build_app` in configs/pd.yaml.

    build_app(args)            validates args (AppConfig), sizes the engine replicas from
                               ray.cluster_resources() and binds one router deployment
    OpenAIRouter.__init__      loads the tokenizer, starts the engine replicas (prefill and
                               decode, or colocated; pooled: and the DistributedKVCache)
                               through the mode's EngineClient, waits until they have loaded
                               the model
    __serve_build_asgi_app__   the FastAPI app of router/api.py

The engine replicas are plain Ray actors owned by the router replica, not Serve deployments:
the router must address one exact replica per request (KV-aware routing, a P and a D that
talk to each other), which Serve's own request routing would hide. Owned actors die with
their router replica, and Serve restarts a failed router, which starts fresh engines; replica
counts come from `num_prefill` / `num_decode` and scale independently.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve

from pd_cluster.config import DEFAULT_MODEL, EngineConfig, ModelConfig, resolve_max_model_len
from pd_cluster.tokenizer import load_tokenizer
from router.api import Router, create_app
from router.app_config import AppConfig, replica_actor_options
from router.metrics import RouterMetrics
from router.routing import RoutingInputs, make_policy
from router.serving import OpenAIServing
from router.streams import LoadMonitor

logger = logging.getLogger(__name__)
# Router replica requests beyond the engines' slots and queue: /health, /metrics, and the
# requests it answers with 429 must still get through Serve's per-replica limit.
SPARE_ONGOING_REQUESTS = 64
# Loading (on first use, converting) the model on every replica must finish within this.
ENGINE_START_TIMEOUT_S = 900.0
# "1" turns on Ray Serve's HAProxy ingress: HAProxy on the HTTP port forwards straight to the
# router replica's own HTTP server, without the Python proxy's extra hop. Ray reads it when it
# starts, so it belongs in the environment of `ray start` / `serve run`, not in a config file.
HAPROXY_INGRESS_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def model_dir(config: AppConfig) -> str:
    if config.engine.model == DEFAULT_MODEL:
        from pd_cluster.default_model import default_model_path
        return default_model_path()
    return config.engine.model


def replica_engine(config: AppConfig, path: str) -> EngineConfig:
    """`config.engine` with max_model_len resolved as the engine would: resolved once by the
    router and handed to every engine replica, so the router's prompt limits and theirs agree."""
    max_model_len = resolve_max_model_len(config.engine, ModelConfig.from_dir(path))
    return config.engine.model_copy(update={"max_model_len": max_model_len})


def start_client(config: AppConfig, engine: EngineConfig,
                 actor_options: Mapping[str, dict[str, Any]]) -> Any:
    """The mode's EngineClient, with its engine replicas started (not yet ready). Pooled mode
    is the disaggregated client with KV through a DistributedKVCache, made in wait_ready."""
    if config.mode == "colocated":
        from router.colocated_client import ColocatedClient
        return ColocatedClient.start(config, engine, actor_options)
    from router.disagg_client import DisaggregatedClient
    return DisaggregatedClient.start(config, engine, actor_options)


@serve.deployment
@serve.ingress()
class OpenAIRouter:
    async def __init__(self, args: dict[str, Any], actor_options: dict[str, dict]) -> None:
        config = AppConfig.from_args(args)
        path = model_dir(config)
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise ValueError(f"engine.model: {config.engine.model!r} has no tokenizer files; "
                             "the router needs one to serve text")
        engine = replica_engine(config, path)
        client = start_client(config, engine, actor_options)
        await client.wait_ready(ENGINE_START_TIMEOUT_S)
        metrics = RouterMetrics(config.engine.model)
        policy = make_policy(config.routing.policy, RoutingInputs(
            config.num_prefill, config.num_decode, engine.block_size,
            config.routing.prefill_weight, config.conditional_disagg_threshold))
        serving = OpenAIServing(config, client, policy, tokenizer, engine.max_model_len, metrics)
        api_key = _api_key(config)
        self.router = Router(serving, LoadMonitor(client, policy, metrics), api_key)
        logger.info("router ready: %s mode, %d prefill + %d decode replicas, auth %s",
                    config.mode, config.num_prefill, config.num_decode,
                    "on" if api_key else "off")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.router)


def _api_key(config: AppConfig) -> str | None:
    if config.api_key_env is None:
        return None
    key = os.environ.get(config.api_key_env)
    if not key:
        raise ValueError(f"api_key_env: environment variable {config.api_key_env} is not "
                         "set on the router's node")
    return key


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder named in configs/pd.yaml (import_path + args)."""
    config = AppConfig.from_args(args)
    if os.environ.get(HAPROXY_INGRESS_ENV) != "1":
        logger.warning("Ray Serve's Python proxy adds ~8 ms per request; start Ray with "
                       "%s=1 for HAProxy ingress", HAPROXY_INGRESS_ENV)
    resources = ray.cluster_resources()
    actor_options = {role: replica_actor_options(config, role, resources)
                     for role in ("prefill", "decode")}
    # replica_actor_options leaves the router one CPU when the cluster has two or more.
    router_cpus = 1.0 if resources.get("CPU", 0) >= 2 else 0.0
    ongoing = (config.num_decode * config.engine.max_num_seqs + config.limits.max_queue
               + SPARE_ONGOING_REQUESTS)
    deployment = OpenAIRouter.options(max_ongoing_requests=ongoing,
                                      ray_actor_options={"num_cpus": router_cpus})
    return deployment.bind(dict(args or {}), actor_options)
