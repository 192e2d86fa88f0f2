"""EngineController: the one owner of an application's engine replicas (a Serve deployment).

    __init__            validates the args, then in the background: resolves the model
                        (router/control/model.py; the bundled default is fetched on first
                        use), adopts the engines a dead controller of the application left
                        running (router/control/engines.py), and starts the EngineFleet
                        (router/control/fleet.py) of the config's prefill and decode replicas
                        around them: a new membership epoch, so every router re-syncs
    model_info()        where the model is and the engine config every replica runs with
                        (router replicas need it to tokenize)
    membership(v, t, e) the fleet's Membership once its version is past v, at once if e is
                        not its epoch (a long poll of at most t seconds): every router
                        replica keeps one open
    serving()           whether every tier has a READY engine, at once (a router replica
                        that starts asks)
    drain(role, id)     stop routing to a replica, wait until it is idle, stop it
    report(samples)     a router replica's finished requests, for the planner (when
                        `planner.enabled`: router/control/planner_loop.py resizes the tiers every
                        interval); answers with the planner's decisions so far
    planner_log()       the planner's recent decisions with their inputs
    (Serve stops it)    it kills its engine actors (`__del__`)
    (its process dies)  the engines go on serving the routers' requests; Serve starts a
                        replacement, which adopts them

Why a Serve deployment of the application, with one replica, and the engines detached Ray
actors it creates, named `pd-<app>-<role>-<id>` and leased:
  - Engines must outlive router replicas and the controller's own replica (minutes of
    model loading, every KV cache, every request in flight), so no replica may own them:
    Ray kills an actor with its owner. Detached, they outlive any replica; named after the
    application, a replacement controller finds them in the namespace and adopts them
    (same actors, no model reload), and `ray list actors` tells one app's P from its D.
  - Engines must die with the application: `serve delete` / `serve shutdown` stops the
    controller's replica gracefully, and it kills them. Should it die instead (no replica
    left to kill them, e.g. the application deleted while its controller was down), each
    engine's lease (actors/engine_lease.py), renewed by the controller every
    ENGINE_LEASE_RENEW_EVERY_S, lapses after ENGINE_LEASE_S and the engine ends itself.
  - Pooled mode's KV pool actors stay owned by the controller: a replacement controller
    finds the engines' pools gone, so it stops the engines it finds and starts afresh.
  - Routers must address one exact engine per request (KV-aware routing, a P and a D that
    talk to each other), which Serve's own request routing over engine deployments would
    hide; the Membership hands routers the actor handles themselves. Each router replica
    keeps its one output stream per engine (router/output_streams.py) and routes from the
    engines' own load and prefix reports; D keeps its reservations, so routers never
    double-book KV.
  - Serve supervises the controller like any replica: if its process dies, Serve replaces
    it (within CONTROLLER_HEALTH_CHECK_S of the death, plus the new process's start).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from pd_cluster.role import Role
from router.app_config import AppConfig
from router.control.engines import running_engines, stop
from router.control.fleet import EngineFleet
from router.control.membership import Membership, ModelInfo
from router.control.model import model_dir, replica_engine
from router.control.planner_loop import LatencySample, PlannerLoop, PlannerView, PlanRecord
from router.control.tier_changes import RoleChange
from router.log_setup import log_info

logger = logging.getLogger(__name__)
LONGEST_POLL_S = 30.0
# Long polls from every router replica stay open here, besides drains and model queries.
MAX_ONGOING = 1000


# A graceful stop waits for the routers' long polls, which their replicas cancel as they stop
# (router/app.py, a couple of seconds in), and then runs `__del__`, which kills the engines.
# Serve kills a replica still stopping after this, `__del__` unrun: its engines then live
# until their leases lapse (ENGINE_LEASE_S), so it outlasts the routers' stop.
STOP_WITHIN_S = 10.0
# Serve notices a dead replica at its next health check: its default (10 s) would leave the
# engines unsupervised, and their leases unrenewed, that much longer.
CONTROLLER_HEALTH_CHECK_S = 2.0


# No access log: its callers are the routers' long polls and reports (a line every 10 s per
# router, forever); its own errors and decisions still log.
@serve.deployment(num_replicas=1, max_ongoing_requests=MAX_ONGOING,
                  ray_actor_options={"num_cpus": 0},
                  health_check_period_s=CONTROLLER_HEALTH_CHECK_S,
                  logging_config={"enable_access_log": False},
                  graceful_shutdown_timeout_s=STOP_WITHIN_S, graceful_shutdown_wait_loop_s=0.5)
class EngineController:
    async def __init__(self, args: dict[str, Any], actor_options: dict[str, dict]) -> None:
        log_info("router.control.fleet", "router.control.engines", "router.control.planner_loop",
                 "router.control.controller", "pd_cluster.default_model")
        self.config = AppConfig.from_args(args)
        self.actor_options = actor_options
        self.fleet: EngineFleet | None = None
        self.planner: PlannerLoop | None = None
        self._info: asyncio.Future = asyncio.get_running_loop().create_future()
        self._start = asyncio.get_running_loop().create_task(self._start_engines())

    async def _start_engines(self) -> None:
        # First the engines a dead controller left, their leases renewed: this process has
        # only just started (importing the engine's modules, below, takes seconds more).
        app = serve.get_replica_context().app_name
        running = await running_engines(app, self.config.mode)
        try:
            # The bundled model's first fetch downloads and converts it: off the event loop.
            path = await asyncio.to_thread(model_dir, self.config)
            engine = replica_engine(self.config, path)
        except Exception as e:  # noqa: BLE001 - every router replica's start reports it
            logger.exception("cannot resolve the model")
            self._info.set_exception(e)
            return
        if running and self.config.mode == "pooled":
            for left in running:
                stop(left)
            running = []
        fleet = EngineFleet.for_app(self.config, engine, self.actor_options, app=app)
        fleet.take_over(running)
        if running:
            logger.info("engine controller: adopted %s", ", ".join(
                f"{e.name} ({e.key[0]}-{e.key[1]})" for e in running))
        self._info.set_result(ModelInfo(path, engine))
        self.fleet = fleet
        self.fleet.start()
        logger.info("engine controller: starting %s", ", ".join(
            f"{n} {role}" for role, n in self.fleet.targets.items()))
        if self.config.planner.enabled:
            self.planner = PlannerLoop.for_app(self.config, engine, self.fleet)
            self.planner.start()

    async def model_info(self, timeout_s: float = 900.0) -> ModelInfo:
        return await asyncio.wait_for(asyncio.shield(self._info), timeout_s)

    async def membership(self, since_version: int = -1, timeout_s: float = 0.0,
                         epoch: str | None = None) -> Membership:
        await self._info
        return await self.fleet.wait_membership(since_version, min(timeout_s, LONGEST_POLL_S),
                                                epoch)

    async def serving(self) -> bool:
        """Whether every tier has a READY engine now (False while the model resolves)."""
        return self.fleet is not None and self.fleet.membership().serving()

    async def drain(self, role: Role, replica_id: int, timeout_s: float = 600.0) -> Membership:
        await self._info
        return await self.fleet.drain(role, replica_id, timeout_s)

    async def report(self, samples: list[LatencySample]) -> PlannerView:
        if self.planner is None:
            return PlannerView(False, {})
        return self.planner.report(samples)

    async def role_changes(self) -> list[RoleChange]:
        """Every role change the fleet made (EngineFleet.flip)."""
        await self._info
        return list(self.fleet.role_changes)

    async def planner_log(self) -> list[PlanRecord]:
        return [] if self.planner is None else list(self.planner.log)

    def __del__(self) -> None:
        # Serve calls this on a graceful stop (the application deleted or shut down): the
        # engines are detached, so nothing else stops them before their leases lapse.
        if self.planner is not None:
            self.planner.stop()
        if self.fleet is not None:
            self.fleet.shutdown()

