"""EngineFleet: one application's engine replicas, started, joined, watched and restarted.

The engine controller (router/control/controller.py) runs one, supervised, and publishes its
Membership to the router replicas. Tests and benchmarks run one in their own process,
unsupervised, over actors they started (`EngineFleet.adopt`), to drive an EngineClient
without Serve: one way to bring engines up either way.

A slot is a (role, replica id); its states are ReplicaState's (router/control/membership.py):
    spawn      a new actor in the slot: PENDING, and its bring-up task starts
    bring-up   waits for the actor's first answer (its model is loaded). Meanwhile, every
               PLACEMENT_CHECK_S, asks Ray whether it has placed the actor: once placed the
               slot is STARTING; still unplaced after UNPLACED_REPORT_S, the slot's `detail`
               and the log say what it asks for and why no node takes it (no node that
               large at all; or taken by others, and, with an autoscaler, that it waits for
               a node). Then it joins the KV handoff with the ready replicas of the other
               role → READY
    health     (supervised) every HEALTH_PERIOD_S, each READY / DRAINING actor's load report
               within HEALTH_TIMEOUT_S. The actor died (RayActorError), or HEALTH_FAILURES
               checks in a row went unanswered (then it is killed) → DEAD
    restart    (supervised) a DEAD slot gets a new actor (PENDING) after a backoff that
               doubles with each death soon after a start, RESTART_BACKOFF_S to
               MAX_BACKOFF_S; a replica that served STABLE_AFTER_S starts over at the base
    leases     (an application's fleet, `for_app(app=...)`) every ENGINE_LEASE_RENEW_EVERY_S,
               each live actor's lease renewed; `take_over` adopts the actors a dead
               controller left running, before `start` (router/control/engines.py)
    changes    drain, add, flip (router/control/tier_changes.py): tiers resized and engines
               moved between roles, no request failing
Every change of a slot's state or actor bumps the version and wakes `membership` long polls.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.engine_lease import ENGINE_LEASE_RENEW_EVERY_S
from actors.messages import ReplicaLoad
from pd_cluster.role import Role
from router.control.engines import RunningEngine, handoff_of, spawner
from router.control.membership import EngineMember, Membership, ReplicaState, check_transition
from router.control.placement import ray_actor_placed, unplaced_reason
from router.control.tier_changes import TierChanges, short_reason as _reason

logger = logging.getLogger(__name__)

PLACEMENT_CHECK_S = 2.0
UNPLACED_REPORT_S = 5.0       # "within seconds": well inside the 30 s a user waits at most
HEALTH_PERIOD_S = 1.0
HEALTH_TIMEOUT_S = TierChanges.answer_timeout_s  # a busy engine's event loop answers within
HEALTH_FAILURES = 3
RESTART_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
STABLE_AFTER_S = 60.0


@dataclass(eq=False)
class _Slot:
    role: Role
    replica_id: int
    resources: dict[str, Any]
    state: ReplicaState = ReplicaState.PENDING
    actor: Any = None
    actor_id: str = ""
    descriptor: bytes | None = None
    load: ReplicaLoad | None = None
    restarts: int = 0
    detail: str = ""
    spawned_at: float = 0.0
    ready_at: float = 0.0
    retry_at: float = 0.0
    quick_deaths: int = 0          # deaths soon after a start, in a row: the backoff's exponent
    misses: int = 0                # health checks in a row without an answer
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[Role, int]:
        return self.role, self.replica_id

    @property
    def name(self) -> str:
        return f"{self.role}-{self.replica_id}"

    def member(self) -> EngineMember:
        return EngineMember(self.role, self.replica_id, self.state, self.actor, self.actor_id,
                            dict(self.resources), self.descriptor, self.load, self.restarts,
                            self.detail)


class EngineFleet(TierChanges):
    """See the module docstring. `spawn(role, replica_id)` makes a new actor for a slot (None
    for a fleet of adopted actors, which cannot restart any)."""

    def __init__(self, mode: str, targets: Mapping[Role, int], handoff: Any,
                 resources: Mapping[Role, dict[str, Any]], spawn: Any = None,
                 supervise: bool = True) -> None:
        self.mode, self.handoff, self.spawn_actor = mode, handoff, spawn
        self.resources = {Role.parse(role): dict(r) for role, r in resources.items()}
        self.targets = {Role.parse(role): n for role, n in targets.items() if n}
        self.supervise = supervise and spawn is not None
        self.version, self.epoch = 0, uuid.uuid4().hex[:12]
        self.slots = {(role, i): _Slot(role, i, dict(self.resources.get(role, {})))
                      for role, n in self.targets.items() for i in range(n)}
        self._changed: asyncio.Event | None = None
        self._join_lock: asyncio.Lock | None = None
        self._supervisor: asyncio.Task | None = None
        self.started = False
        self.leased, self._renewed_at = False, 0.0    # whether it renews its actors' leases
        self.role_changes: list = []      # RoleChange (router/control/tier_changes.py), in order

    @classmethod
    def for_app(cls, config: Any, engine: Any, actor_options: Mapping[Role, dict[str, Any]],
                supervise: bool = True, app: str | None = None) -> EngineFleet:
        """The fleet of an application's config (AppConfig): its mode's actors and handoff,
        `actor_options[role]` for each replica; actors are made when it starts. With `app`
        (the controller's), they are detached, named and leased (router/control/engines.py)
        and the fleet renews their leases."""
        fleet = cls(config.mode, {Role.PREFILL: config.num_prefill,
                                  Role.DECODE: config.num_decode}, handoff_of(config),
                    actor_options, spawner(config, engine, actor_options, app), supervise)
        fleet.leased = app is not None
        return fleet

    @classmethod
    def adopt(cls, mode: str, prefill: Sequence[Any], decode: Sequence[Any],
              handoff: Any = None) -> EngineFleet:
        """A fleet over actors already created (tests, benchmarks); never restarts them."""
        fleet = cls(mode, {Role.PREFILL: len(prefill), Role.DECODE: len(decode)}, handoff, {})
        for role, actors in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            for i, actor in enumerate(actors):
                slot = fleet.slots[(role, i)]
                slot.actor, slot.actor_id = actor, actor._actor_id.hex()
        return fleet

    def take_over(self, running: Sequence[RunningEngine]) -> None:
        """Before `start`: a slot for each engine a dead controller left running (READY if its
        handoff is open), and the config's own slots for what they leave short of a target."""
        wanted, self.slots, self.targets = dict(self.targets), {}, {}
        for engine in running:
            role, replica_id = engine.key
            slot = self._new_slot(role, self.resources.get(role, {}), replica_id)
            slot.actor, slot.actor_id, slot.load = engine.actor, engine.actor_id, engine.load
            if engine.descriptor is not None or self.handoff is None:
                slot.state, slot.descriptor = ReplicaState.READY, engine.descriptor
                slot.ready_at = time.monotonic()
        for role, n in wanted.items():
            for _ in range(n - self.targets.get(role, 0)):
                self._new_slot(role, self.resources.get(role, {}))

    # -- the published view -----------------------------------------------------------------
    def membership(self) -> Membership:
        return Membership(self.version, self.mode, dict(self.targets),
                          tuple(s.member() for s in self.slots.values()), self.handoff,
                          self.epoch)

    async def wait_membership(self, since_version: int, timeout_s: float,
                              epoch: str | None = None) -> Membership:
        """The membership once its version is past `since_version`, or after `timeout_s`; at
        once when the caller's view is of another `epoch` (None: any)."""
        deadline = time.monotonic() + timeout_s
        while self.version <= since_version and epoch in (None, self.epoch):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._event().wait(), left)
            except asyncio.TimeoutError:
                break
        return self.membership()

    async def wait_serving(self, timeout_s: float, every: bool = True) -> Membership:
        """Start (if not yet) and return the membership once every slot is READY or RETIRED (`every`;
        else once every role has one). TimeoutError says which replicas are not."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.membership()
            done = (all(s.state in (ReplicaState.READY, ReplicaState.RETIRED)
                        for s in self.slots.values()) if every else m.serving())
            if done:
                return m
            if not self.supervise and any(s.state is ReplicaState.DEAD
                                          for s in self.slots.values()):
                raise RuntimeError("engine replicas failed to start: " + m.not_ready())
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"engine replicas not ready after {timeout_s:g} s: "
                                   + m.not_ready())
            try:
                await asyncio.wait_for(self._event().wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn (or, adopted, bring up) every slot; supervised, start watching. Idempotent
        within one event loop."""
        loop = asyncio.get_running_loop()
        for slot in self.slots.values():
            alive = slot.task is not None and not slot.task.done() \
                and slot.task.get_loop() is loop
            if slot.state is ReplicaState.PENDING and not alive:
                if slot.actor is None:
                    self._spawn(slot)
                else:
                    slot.spawned_at = time.monotonic()
                    slot.task = loop.create_task(self._bring_up(slot))
        if self.supervise and (self._supervisor is None or self._supervisor.done()):
            self._supervisor = loop.create_task(self._supervise())
        self.started = True

    def _new_slot(self, role: Role, resources: dict[str, Any], replica_id: int | None = None
                  ) -> _Slot:
        slot = _Slot(role, self._next_id(role) if replica_id is None else replica_id,
                     dict(resources))
        self.slots[slot.key] = slot
        self.targets[role] = self.targets.get(role, 0) + 1
        return slot

    def _next_id(self, role: Role) -> int:
        """Replica ids are never reused: a router may still hold the old one's state."""
        return 1 + max((i for r, i in self.slots if r == role), default=-1)

    def shutdown(self) -> None:
        """Stop watching and kill every engine (and the KV pool); the fleet is done."""
        if self._supervisor is not None:
            self._supervisor.cancel()
        for slot in self.slots.values():
            if slot.task is not None:
                slot.task.cancel()
            self._kill(slot)
        pool = getattr(self.handoff, "pool", None)
        if pool is not None:
            ray.kill(pool)

    # -- internals --------------------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None or self._changed._loop not in (None, _loop()):  # noqa: SLF001
            self._changed = asyncio.Event()
        return self._changed

    def _bump(self) -> None:
        self.version += 1
        event, self._changed = self._event(), asyncio.Event()
        event.set()

    def _set(self, slot: _Slot, state: ReplicaState, detail: str = "") -> None:
        if slot.state is not state:
            check_transition(slot.state, state)
        slot.state, slot.detail = state, detail
        self._bump()

    def _spawn(self, slot: _Slot) -> None:
        if slot.actor is not None or slot.actor_id:
            slot.restarts += 1
        slot.actor = self.spawn_actor(slot.role, slot.replica_id)
        slot.actor_id, slot.descriptor, slot.load = slot.actor._actor_id.hex(), None, None
        slot.spawned_at, slot.misses = time.monotonic(), 0
        if slot.state is not ReplicaState.PENDING:
            self._set(slot, ReplicaState.PENDING)
        else:
            self._bump()
        slot.task = asyncio.get_running_loop().create_task(self._bring_up(slot))

    async def _bring_up(self, slot: _Slot) -> None:
        actor = slot.actor
        joining = False
        try:
            first = asyncio.ensure_future(actor.load.remote())
            while True:
                done, _ = await asyncio.wait({first}, timeout=PLACEMENT_CHECK_S)
                if done:
                    break
                self._check_placement(slot)
            slot.load = first.result()
            if slot.state is ReplicaState.PENDING:
                self._set(slot, ReplicaState.STARTING)
            if self.handoff is not None:
                slot.descriptor = await actor.kv_descriptor.remote()
                joining = True
                async with self._lock():
                    await self.handoff.join(actor, slot.descriptor, self._peers(slot))
            if slot.actor is actor and slot.state is ReplicaState.STARTING:
                slot.ready_at = time.monotonic()
                self._set(slot, ReplicaState.READY)
                logger.info("engine replica %s ready (actor %s)", slot.name, slot.actor_id)
        except asyncio.CancelledError:
            raise
        except (RayActorError, RayTaskError) as e:
            if slot.actor is actor and joining and isinstance(e, RayTaskError):
                # The actor is alive but refused the handoff, e.g. a peer's KV layout (its
                # dtype: kv_cache_dtype) differs: the reason, not "failed to start".
                self._kill(slot)
                self._died(slot, f"failed to join the KV handoff: {_reason(e)}")
            elif slot.actor is actor:
                self._died(slot, f"failed to start: {_reason(e)}")
        except Exception as e:  # noqa: BLE001 - e.g. the handoff could not join: retry it
            logger.exception("engine replica %s failed to join", slot.name)
            if slot.actor is actor:
                self._kill(slot)
                self._died(slot, f"failed to join the KV handoff: {e!r}")

    def _peers(self, slot: _Slot) -> list[tuple[Any, bytes]]:
        return [(s.actor, s.descriptor) for s in self.slots.values()
                if s.role == slot.role.other and s.state is ReplicaState.READY and s.descriptor]

    def _lock(self) -> asyncio.Lock:
        # Replicas join one at a time: each sees every peer that joined before it.
        if self._join_lock is None or self._join_lock._loop not in (None, _loop()):  # noqa: SLF001
            self._join_lock = asyncio.Lock()
        return self._join_lock

    def _check_placement(self, slot: _Slot) -> None:
        if not ray_actor_placed(slot.actor_id):
            waited = time.monotonic() - slot.spawned_at
            if waited >= UNPLACED_REPORT_S and slot.state is ReplicaState.PENDING:
                detail = unplaced_reason(slot.resources)
                if detail != slot.detail:
                    logger.warning("engine replica %s is not placed after %.0f s: it %s",
                                   slot.name, waited, detail)
                    self._set(slot, ReplicaState.PENDING, detail)
        elif slot.state is ReplicaState.PENDING:
            self._set(slot, ReplicaState.STARTING, "placed: loading the model")

    async def _supervise(self) -> None:
        while True:
            try:
                await self._check_health()
                now = time.monotonic()
                if self.leased and now - self._renewed_at >= ENGINE_LEASE_RENEW_EVERY_S:
                    self._renew_leases(now)
                for slot in self.slots.values():
                    if slot.state is ReplicaState.DEAD and now >= slot.retry_at:
                        logger.info("restarting engine replica %s (restart %d)", slot.name,
                                    slot.restarts + 1)
                        self._spawn(slot)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one failure
                logger.exception("engine supervision failed; trying again")
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _check_health(self) -> None:
        watched = [s for s in self.slots.values()
                   if s.state in (ReplicaState.READY, ReplicaState.DRAINING)]
        replies = await asyncio.gather(*[asyncio.wait_for(s.actor.load.remote(),
                                                          HEALTH_TIMEOUT_S)
                                         for s in watched], return_exceptions=True)
        for slot, reply in zip(watched, replies):
            if isinstance(reply, ReplicaLoad):
                slot.load, slot.misses = reply, 0
            elif isinstance(reply, RayActorError):
                self._died(slot, f"died: {_reason(reply)}")
            else:
                slot.misses += 1
                if slot.misses >= HEALTH_FAILURES:
                    self._kill(slot)
                    self._died(slot, f"stopped answering health checks ({slot.misses} in a "
                                     f"row, {_reason(reply)})")

    def _renew_leases(self, now: float) -> None:
        # Fire and forget: a dead actor shows at the next health check.
        self._renewed_at = now
        for slot in self.slots.values():
            if slot.actor is not None and slot.state is not ReplicaState.RETIRED:
                slot.actor.renew_lease.remote()

    def _died(self, slot: _Slot, detail: str) -> None:
        now = time.monotonic()
        stable = slot.ready_at and now - slot.ready_at >= STABLE_AFTER_S
        slot.quick_deaths = 0 if stable else slot.quick_deaths + 1
        backoff = min(MAX_BACKOFF_S, RESTART_BACKOFF_S * 2 ** max(0, slot.quick_deaths - 1))
        slot.retry_at, slot.ready_at = now + backoff, 0.0
        logger.warning("engine replica %s (actor %s) %s%s", slot.name, slot.actor_id, detail,
                       f"; restarting in {backoff:g} s" if self.supervise else "")
        slot.actor, slot.descriptor = None, None
        if slot.state not in (ReplicaState.DEAD, ReplicaState.RETIRED):
            self._set(slot, ReplicaState.DEAD, detail)

    def _kill(self, slot: _Slot) -> None:
        if slot.actor is not None:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def _loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

