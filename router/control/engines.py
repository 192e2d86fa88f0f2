"""How an application's engine actors are made, named, and found again by a controller that
replaces a dead one (router/control/controller.py says why they are detached).

    handoff_of(config)          the mode's KV handoff (None: colocated)
    engine_name(app, role, id)  "pd-<app>-<role>-<id>": `ray list actors` and the dashboard
                                tell one application's P from its D (a replica that changed
                                roles keeps the name it was started with)
    spawner(config, ...)        the EngineFleet's way to start a slot's actor: with `app`,
                                detached, named, and with a lease of ENGINE_LEASE_S
                                (actors/engine_lease.py) the fleet renews; without, owned by
                                the caller (tests and benchmarks), as any actor
    running_engines(app, mode)  the application's named engines alive in this namespace, each
                                with its own word on its role and replica id (a role change
                                moves it to another slot), its lease renewed at once, and its
                                KV descriptor if its handoff is open; those that do not answer
                                are stopped (they would hold their names)
The fleet takes them over (EngineFleet.take_over) before it starts anything of its own.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from actors.engine_lease import ENGINE_LEASE_S
from actors.messages import ReplicaLoad
from pd_cluster.role import Role

logger = logging.getLogger(__name__)

NAME_PREFIX = "pd"
# An engine left running answers within this or is stopped: a busy engine's event loop
# answers within seconds (router/control/tier_changes.py: answer_timeout_s).
ADOPT_ANSWER_S = 10.0


def handoff_of(config: Any) -> Any:
    if config.mode == "colocated":
        return None
    if config.mode == "pooled":
        from actors.pool_handoff import PoolHandoff
        return PoolHandoff(float(config.limits.request_timeout_s), config.kv_pool)
    from actors.handoff import PushHandoff
    return PushHandoff()


def engine_name(app: str, role: Role, replica_id: int) -> str:
    return f"{NAME_PREFIX}-{app}-{role}-{replica_id}"


def _of_app(name: str, app: str) -> bool:
    # The role and id are matched from the end: an application's name may hold dashes.
    return re.fullmatch(rf"{NAME_PREFIX}-{re.escape(app)}-(prefill|decode)-\d+(-[0-9a-f]+)?",
                        name) is not None


@dataclass(frozen=True, slots=True)
class RunningEngine:
    """An engine actor a previous controller of the application left running."""

    name: str
    actor: Any
    actor_id: str
    load: ReplicaLoad                 # its own report: its role and replica id now
    descriptor: bytes | None = None   # its KV descriptor once its handoff is open (else None)

    @property
    def key(self) -> tuple[Role, int]:
        return Role.parse(self.load.role), self.load.replica_id


def spawner(config: Any, engine: Any, actor_options: Mapping[Role, dict[str, Any]],
            app: str | None) -> Any:
    """`spawn(role, replica_id)`: a new engine actor for a slot (see the module docstring)."""
    timeout = float(config.limits.request_timeout_s)

    def spawn(role: Role, replica_id: int) -> Any:
        options: dict[str, Any] = {**actor_options[role], "max_restarts": 0}
        lease = None
        if app is not None:
            options.update(name=engine_name(app, role, replica_id), lifetime="detached")
            lease = ENGINE_LEASE_S
        role_engine = config.role_engine(engine, role)   # its tensor-parallel size
        # The KV tiers (actors/kv_tiers.py) ride along only when on: off, the actors' own
        # default (None) keeps an older actor class's signature.
        tiers = getattr(config, "kv_tiers", None)
        extra = {"kv_tiers": tiers} if tiers is not None and tiers.enabled else {}
        if config.mode == "colocated":
            from actors.colocated_actor import ColocatedActor as actor_class
            args: tuple = (role_engine, replica_id, timeout)
        else:
            from actors.engine_actor import EngineActor as actor_class
            args = (role_engine, role, replica_id, config.transport, timeout)
        try:
            return actor_class.options(**options).remote(*args, engine_lease_s=lease, **extra)
        except ValueError:
            # The name is still held: the slot's previous actor, killed a moment ago, not yet
            # gone, or an actor that changed roles into another slot. A suffix keeps it apart.
            options["name"] += f"-{uuid.uuid4().hex[:6]}"
            return actor_class.options(**options).remote(*args, engine_lease_s=lease, **extra)
    return spawn


async def running_engines(app: str, mode: str) -> list[RunningEngine]:
    """See the module docstring; one engine per slot (a second claiming a slot is stopped)."""
    try:
        handles = await asyncio.to_thread(_named_actors, app)
    except Exception:  # noqa: BLE001 - none adopted: the fleet starts its own
        logger.exception("cannot list the engines left running")
        return []
    found = await asyncio.gather(*[_ask(name, actor, mode) for name, actor in handles])
    by_slot: dict[tuple[Role, int], RunningEngine] = {}
    for engine in filter(None, found):
        if engine.key in by_slot:
            logger.warning("engine %s claims slot %s-%d, which %s holds: stopping it",
                           engine.name, *engine.key, by_slot[engine.key].name)
            stop(engine)
        else:
            by_slot[engine.key] = engine
    return list(by_slot.values())


def stop(engine: RunningEngine) -> None:
    _kill(engine.actor)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _named_actors(app: str) -> list[tuple[str, Any]]:
    out = []
    for name in ray.util.list_named_actors():
        if _of_app(name, app):
            try:
                out.append((name, ray.get_actor(name)))
            except ValueError:      # died since it was listed
                pass
    return out


async def _ask(name: str, actor: Any, mode: str) -> RunningEngine | None:
    try:
        await asyncio.wait_for(actor.renew_lease.remote(), ADOPT_ANSWER_S)
        load = await asyncio.wait_for(actor.load.remote(), ADOPT_ANSWER_S)
        descriptor = None
        if mode != "colocated" and await asyncio.wait_for(actor.handoff_open.remote(),
                                                          ADOPT_ANSWER_S):
            descriptor = await asyncio.wait_for(actor.kv_descriptor.remote(), ADOPT_ANSWER_S)
    except Exception as e:  # noqa: BLE001 - dead, hung or still loading: start afresh
        logger.warning("engine %s left running does not answer (%r): stopping it", name, e)
        _kill(actor)
        return None
    return RunningEngine(name, actor, actor._actor_id.hex(), load, descriptor)
