"""The Ray Serve application: `import_path: router.app:build_app` in configs/pd.yaml.

    build_app(args)            validates args (AppConfig), sizes the engine replicas from
                               ray.cluster_resources(), binds the EngineController
                               (router/control/controller.py) and the router deployment,
                               both on the head when the engines have node groups of their
                               own (head_of_engine_groups)
    OpenAIRouter.__init__      checks the args; in the background it asks the controller for
                               the model (to load the tokenizer) and the engines' membership,
                               and routes over them; it starts no engine, so a replacement
                               router serves within seconds. Returns at once at the
                               application's first start, else once it serves (Serve sends a
                               replica requests from then on)
    __serve_build_asgi_app__   router/replica_app.py's app: 503 saying why while the replica
                               starts, then the FastAPI app of router/api.py

Two deployments: `EngineController` (one replica) owns the engine replicas, plain Ray
actors (why: router/control/controller.py); `OpenAIRouter` (`router_replicas`, or Serve's
autoscaling) is stateless: any number of replicas route over the same engines, each from the
engines' own load and prefix reports, each with its own output stream per engine. A router
replica that dies loses only its own streams: the engines end its requests when its
subscriber lease expires (actors/subscribers.py).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import ray
from ray import serve

from pd_cluster.config import EngineConfig
from pd_cluster.role import Role
from pd_cluster.tokenizer import load_tokenizer
from router.api import Router, create_app
from router.app_config import AppConfig, replica_actor_options
from router.control.controller import EngineController
from router.engine_client import answer_within
from router.log_setup import log_info
from router.replica_app import ReplicaApp, StartState
from router.metrics import RouterMetrics
from router.tracing import Tracing
from router.routing import RoutingInputs, make_policy
from router.serving import OpenAIServing
from router.streams import LoadMonitor, MembershipWatcher
from router.tenants import Tenants

logger = logging.getLogger(__name__)
# Serve replaces a router replica whose process died at its next health check.
ROUTER_HEALTH_CHECK_S = 2.0
# Which router replica answered: every answer names it (a client or a test tells them apart).
ROUTER_HEADER = "x-pd-router"
# Behind HAProxy a stopping router replica first stays reachable this long, for load
# balancers to drop it (Serve's default, 30 s, made Ctrl-C of `serve run` take 33 s). Our
# HAProxy learns of a stopping replica within a second; a late connection is refused and
# HAProxy retries another replica.
ROUTER_DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
# Router replica requests beyond the engines' slots and queue: /health, /metrics, and the
# requests it answers with 429 must still get through Serve's per-replica limit.
SPARE_ONGOING_REQUESTS = 64
# Loading (on first use, converting) the model on every replica must finish within this.
ENGINE_START_TIMEOUT_S = 900.0
# A router replica that joins a serving application waits this long at most to serve before
# Serve sends it requests (it loads the tokenizer and the membership: seconds).
JOIN_SERVING_WITHIN_S = 60.0
# The controller's answer to whether the application serves: at once, but a new replica's
# first call through its handle takes seconds on a busy machine.
SERVING_ASK_S = 15.0
# Ray's resource of the head node alone; a replica asking for a sliver of it runs there.
HEAD_NODE_RESOURCE = "node:__internal_head__"
HEAD_SHARE = 0.001
# "1" turns on Ray Serve's HAProxy ingress: HAProxy on the HTTP port forwards straight to the
# router replica's own HTTP server, without the Python proxy's extra hop. Ray reads it when it
# starts, so it belongs in the environment of `ray start` / `serve run`, not in a config file.
HAPROXY_INGRESS_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# HAProxy retries a request on another router replica when the one it picked closed the
# connection without answering (its process died), not only when the connection failed
# (Ray's default): a request on a kept-alive connection to a replica killed a moment before
# would otherwise fail. Nothing of it ran (a replica that died mid-answer is not retried),
# and a completion has no side effect to double. Ray reads it when it starts, as above.
HAPROXY_RETRY_ENV = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response"}


def start_client(config: AppConfig, engine: EngineConfig,
                 actor_options: Mapping[Role, dict[str, Any]]) -> Any:
    """The mode's EngineClient, with its engine replicas started (not yet ready). Pooled mode
    is the disaggregated client with KV through a DistributedKVCache, made in wait_ready."""
    if config.mode == "colocated":
        from router.colocated_client import ColocatedClient
        return ColocatedClient.start(config, engine, actor_options)
    from router.disagg_client import DisaggregatedClient
    return DisaggregatedClient.start(config, engine, actor_options)


def make_client(config: AppConfig, engine: EngineConfig) -> Any:
    """The mode's EngineClient without engines of its own: a router replica feeds it the
    controller's membership."""
    timeout = float(config.limits.request_timeout_s)
    if config.mode == "colocated":
        from router.colocated_client import ColocatedClient
        return ColocatedClient(timeout)
    from router.disagg_client import DisaggregatedClient
    return DisaggregatedClient(config.prefill_failure_policy == "recompute", timeout,
                               max_migrations=config.limits.max_migrations)


@serve.deployment(health_check_period_s=ROUTER_HEALTH_CHECK_S)
@serve.ingress()
class OpenAIRouter:
    async def __init__(self, args: dict[str, Any], controller: Any) -> None:
        config = AppConfig.from_args(args)      # a bad config fails the deployment at once
        tenants = _tenants(config)
        log_info("router.app", "router.streams")
        name = _replica_name() or f"router-{os.getpid()}"
        self.router: Router | None = None
        self.replica_app = ReplicaApp(name, ROUTER_HEADER)
        self._start = asyncio.get_running_loop().create_task(
            self._start_routing(config, controller, tenants, name))
        # Serve hands a replica traffic once this returns. While the application serves (this
        # replica replaces a dead one, or is added), the others answer meanwhile: return once
        # this one serves too, not with a 503 to every request the ingress sends here. The
        # first replicas return at once and answer 503 saying what they wait for.
        if await _app_serving(controller):
            await asyncio.wait({self._start}, timeout=JOIN_SERVING_WITHIN_S)

    async def _start_routing(self, config: AppConfig, controller: Any,
                             tenants: Tenants | None, name: str) -> None:
        """Until this is done, ReplicaApp answers 503 saying what the start waits for."""
        try:
            self.replica_app.waiting_for("the engine controller is resolving the model (the "
                                         "bundled one is fetched and converted on first use)")
            info = await controller.model_info.remote(ENGINE_START_TIMEOUT_S)
            self.replica_app.waiting_for("loading the tokenizer")
            tokenizer = await asyncio.to_thread(load_tokenizer, info.path)
            if tokenizer is None:
                raise ValueError(f"engine.model: {config.engine.model!r} has no tokenizer "
                                 "files; the router needs one to serve text")
            engine: EngineConfig = info.engine
            client = make_client(config, engine)
            metrics = RouterMetrics(config.engine.model)
            metrics.collect_samples = config.planner.enabled
            if hasattr(client, "transfers"):    # the P/D client: per-transfer metrics
                client.transfers, client.transport = metrics.transfers, config.transport
            policy = make_policy(config.routing.policy, RoutingInputs(
                config.num_prefill, config.num_decode, engine.block_size,
                config.routing.prefill_weight, config.conditional_disagg_threshold))
            serving = OpenAIServing(config, client, policy, tokenizer, engine.max_model_len,
                                    metrics)
            serving.tracing = Tracing.start(config.tracing, name)
            watcher = MembershipWatcher(controller, client, policy, serving.admission, metrics,
                                        engine.max_num_seqs, await asyncio.to_thread(api_url))
            # Re-attach to the running engines (a replacement router loads no model).
            watcher.apply(await controller.membership.remote(-1, 0.0))
            watcher.ensure_started()
            self.router = Router(serving, LoadMonitor(client, policy, metrics), watcher,
                                 tenants, name)
            self.replica_app.serve(create_app(self.router))
            logger.info("router %s up: %s mode, %d prefill + %d decode replicas wanted, auth "
                        "%s", name, config.mode, config.num_prefill, config.num_decode,
                        "on" if tenants else "off")
        except Exception as e:  # noqa: BLE001 - said in every answer and by check_health
            logger.exception("router %s failed to start", name)
            self.replica_app.fail(str(e) or repr(e))

    def __serve_build_asgi_app__(self) -> ReplicaApp:
        return self.replica_app

    def check_health(self) -> None:
        """Serve's health check: a replica whose start failed is replaced (and the reason
        logged) rather than left answering 503 forever."""
        if self.replica_app.state is StartState.FAILED:
            raise RuntimeError(f"router replica failed to start: {self.replica_app.reason}")

    def __del__(self) -> None:
        # Serve calls this on a graceful stop, once the replica's requests are done: end the
        # membership long poll, which would hold the engine controller's stop for seconds.
        start = getattr(self, "_start", None)
        if start is not None and not start.done():
            start.cancel()
        router = getattr(self, "router", None)
        if router is not None and router.watcher is not None:
            router.watcher.stop()


async def _app_serving(controller: Any) -> bool:
    """Whether the application serves already (every tier has a READY engine); False while
    its controller resolves the model or does not answer."""
    try:
        return await answer_within(controller.serving.remote(), SERVING_ASK_S)
    except Exception:  # noqa: BLE001 - no answer: as at the first start
        return False


def api_url() -> str | None:
    """The OpenAI base URL Serve's proxies listen on (None when Serve does not say)."""
    try:
        from ray.serve.context import _get_global_client
        root = _get_global_client().root_url
    except Exception:  # noqa: BLE001 - the ready line then names no URL
        return None
    if not root:
        return None
    return root.replace("//0.0.0.0:", "//localhost:").replace("//[::]:", "//localhost:") + "/v1"


def _replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests build the app directly)
        return ""


def _tenants(config: AppConfig) -> Tenants | None:
    """Who may call: config.tenants, or api_key_env's one key; None: anybody."""
    if config.tenants:
        return Tenants.from_config(config.tenants, config.router_replicas)
    if config.api_key_env is None:
        return None
    key = os.environ.get(config.api_key_env)
    if not key:
        raise ValueError(f"api_key_env: environment variable {config.api_key_env} is not "
                         "set on the router's node")
    return Tenants.single(key)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder named in configs/pd.yaml (import_path + args): the engine
    controller and the router deployment, which gets the controller's handle."""
    config = AppConfig.from_args(args)
    if os.environ.get(HAPROXY_INGRESS_ENV) != "1":
        logger.warning("Ray Serve's Python proxy adds ~8 ms per request; start Ray with "
                       "%s=1 for HAProxy ingress", HAPROXY_INGRESS_ENV)
    elif any(os.environ.get(k) != v for k, v in HAPROXY_RETRY_ENV.items()):
        logger.warning("requests in flight to a router replica as it dies fail; start Ray "
                       "with %s", " ".join(f"{k}='{v}'" for k, v in HAPROXY_RETRY_ENV.items()))
    resources = ray.cluster_resources()
    actor_options = {role: replica_actor_options(config, role, resources) for role in Role}
    head = head_of_engine_groups(resources)
    pin = {"resources": {HEAD_NODE_RESOURCE: HEAD_SHARE}} if head is not None else {}
    controller = EngineController.options(ray_actor_options={"num_cpus": 0, **pin}).bind(
        dict(args or {}), actor_options)
    ongoing = (config.most_replicas(Role.DECODE) * config.engine.max_num_seqs
               + config.limits.max_queue + SPARE_ONGOING_REQUESTS)
    scaling = config.router_deployment_options()
    deployment = OpenAIRouter.options(
        max_ongoing_requests=ongoing, **scaling,
        ray_actor_options={"num_cpus": router_cpus(config, config.router_max_replicas, resources,
                                                   actor_options, head),
                           "runtime_env": {"env_vars": ROUTER_DRAIN_ENV}, **pin})
    return deployment.bind(dict(args or {}), controller)


def head_of_engine_groups(resources: Mapping[str, float]) -> dict[str, float] | None:
    """The head node's resources when the engines have node groups of their own (nodes that
    advertise the "prefill" / "decode" resource, configs/cluster.yaml and the Helm chart;
    the head does not), else None. The router and controller replicas then run on the head:
    Serve spreads replicas over every node with a free CPU, and a router placed on an engine
    node before its engine takes the CPU the engine asks for (503 for as long as it waits)."""
    head = next((n["Resources"] for n in ray.nodes()
                 if n.get("Alive") and HEAD_NODE_RESOURCE in n["Resources"]), None)
    if head is None or any(head.get(str(role), 0) > 0 for role in Role):
        return None
    return head if any(resources.get(str(role), 0) > 0 for role in Role) else None


def router_cpus(config: AppConfig, routers: int, resources: Mapping[str, float],
                actor_options: Mapping[Role, dict[str, Any]],
                head: Mapping[str, float] | None = None) -> float:
    """CPUs of each of (at most) `routers` router replicas: one where the cluster has them
    beside the engines, else an equal share of what the engines leave
    (replica_actor_options leaves one CPU); with `head` (they run there, no engine does),
    of the head's CPUs."""
    cpus = {role: actor_options[role].get("num_cpus", 1.0) for role in Role}
    if head is not None:
        engines, resources = 0.0, head
    elif config.planner.enabled:    # the most engines that can run at once, of either role
        engines = max(cpus.values()) * config.most_engine_replicas()
    else:
        engines = sum(cpus[role] * getattr(config, f"num_{role}") for role in Role)
    spare = resources.get("CPU", 0) - engines
    if spare >= routers:
        return 1.0
    return max(0.0, math.floor(100 * spare / routers) / 100)
