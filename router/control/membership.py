"""Membership: which engine replicas exist, what state each is in, how to reach it.

The EngineController (router/control/controller.py) owns the engine replicas and publishes a
Membership with a version that grows on every change of a replica's state or actor; router
replicas long-poll it and route over the READY members. Loads and prefix reports do not bump
the version: routers ask the engines for those themselves.

Lifecycle of one replica slot (role, replica id), `ReplicaState`:

    PENDING ──► STARTING ──► READY ◄─► DRAINING ──► RETIRED
       │            │          │           │
       └────────────┴──────────┴───────────┴──► DEAD ──(backoff)──► PENDING (a new actor)

PENDING: the actor is created but Ray has not placed it (it waits for resources: `detail`
says what it asks for and why it does not fit). STARTING: placed, loading the model and
joining the KV handoff. DEAD: its process died or stopped answering health checks; the
controller starts a new actor in the same slot after a backoff. RETIRED: drained and stopped
on purpose (the planner removed it), or moved to a slot of the other role with the same actor
(a role change); never restarted. DRAINING goes back to READY when a role change is given up.
Replica ids are never reused, so they need not be dense.

No Ray import: routers, the controller and tests share these types.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from actors.messages import ReplicaLoad
from pd_cluster.role import Role

Key = tuple[Role, int]    # (role, replica id)


class ReplicaState(str, enum.Enum):
    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    RETIRED = "retired"

    def __str__(self) -> str:
        return self.value


TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.PENDING: frozenset({ReplicaState.STARTING, ReplicaState.DEAD,
                                     ReplicaState.RETIRED}),
    ReplicaState.STARTING: frozenset({ReplicaState.READY, ReplicaState.DEAD,
                                      ReplicaState.RETIRED}),
    ReplicaState.READY: frozenset({ReplicaState.DRAINING, ReplicaState.DEAD}),
    # Back to READY: a role change given up (the replica stayed busy past the timeout).
    ReplicaState.DRAINING: frozenset({ReplicaState.RETIRED, ReplicaState.DEAD,
                                      ReplicaState.READY}),
    ReplicaState.DEAD: frozenset({ReplicaState.PENDING, ReplicaState.RETIRED}),
    ReplicaState.RETIRED: frozenset(),
}


def check_transition(old: ReplicaState, new: ReplicaState) -> None:
    if new not in TRANSITIONS[old]:
        raise ValueError(f"replica state {old} cannot become {new}")


class TierState(str, enum.Enum):
    """A tier (the replicas of one role) as a whole, as /health reports it."""

    READY = "ready"          # every wanted replica is READY
    DEGRADED = "degraded"    # some are READY, not all: it serves, with less capacity
    PENDING = "pending"      # none is READY: requests needing this role cannot be served

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class EngineMember:
    """One replica slot as the controller last saw it."""

    role: Role                        # colocated engines are DECODE replicas
    replica_id: int
    state: ReplicaState
    actor: Any = None                 # its Ray actor handle (None when there is no live one)
    actor_id: str = ""                # hex id of that actor: a new one after each restart
    resources: dict[str, Any] = field(default_factory=dict)   # the Ray options it asks for
    descriptor: bytes | None = None   # its encoded KVDescriptor (None: colocated, or not yet)
    load: ReplicaLoad | None = None   # its report at the controller's last health check
    restarts: int = 0                 # actors started in this slot after the first
    detail: str = ""                  # why it is PENDING, or how it died

    @property
    def key(self) -> Key:
        return self.role, self.replica_id

    def summary(self) -> dict[str, Any]:
        """What /health shows of it."""
        out: dict[str, Any] = {"replica": f"{self.role}-{self.replica_id}",
                               "state": str(self.state), "actor_id": self.actor_id,
                               "restarts": self.restarts}
        if self.state in (ReplicaState.PENDING, ReplicaState.DEAD) or self.detail:
            out["resources"] = self.resources
            out["detail"] = self.detail
        return out


@dataclass(frozen=True, slots=True)
class Membership:
    """The controller's published view; `version` grows with every change. `epoch` names
    the fleet (a controller that Serve replaced starts a new one, at version 0): a membership
    of another epoch is newer whatever its version (`newer_than`)."""

    version: int
    mode: str                                # AppConfig.mode
    targets: dict[Role, int]                 # wanted replicas per role (its tier's size)
    members: tuple[EngineMember, ...] = ()
    handoff: Any = None                      # the KVHandoff the engines run (None: colocated)
    epoch: str = ""

    def newer_than(self, other: Membership | None) -> bool:
        return other is None or self.epoch != other.epoch or self.version > other.version

    def of(self, role: Role) -> list[EngineMember]:
        return sorted((m for m in self.members if m.role == role), key=lambda m: m.replica_id)

    def ready(self, role: Role) -> list[EngineMember]:
        return [m for m in self.of(role) if m.state is ReplicaState.READY]

    def roles(self) -> list[Role]:
        """The roles with a tier (some replicas wanted), prefill first."""
        return [r for r in Role if self.targets.get(r)]

    def tier_state(self, role: Role) -> TierState:
        ready = len(self.ready(role))
        if ready == 0:
            return TierState.PENDING
        return TierState.READY if ready >= self.targets.get(role, 0) else TierState.DEGRADED

    def not_ready(self) -> str:
        """The replicas neither READY nor RETIRED, each with its state and why."""
        return "; ".join(f"{m.role}-{m.replica_id} {m.state}"
                         + (f" ({m.detail})" if m.detail else "") for m in self.members
                         if m.state not in (ReplicaState.READY, ReplicaState.RETIRED))

    def serving(self) -> bool:
        """Whether every tier has a READY replica (requests can be served)."""
        return all(self.tier_state(r) is not TierState.PENDING for r in self.roles())

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Per tier, by role: its state, ready / wanted counts and each replica's summary
        (/health)."""
        return {str(role): {"state": str(self.tier_state(role)),
                            "ready": len(self.ready(role)),
                            "target": self.targets.get(role, 0),
                            "replicas": [m.summary() for m in self.of(role)]}
                for role in self.roles()}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a router replica needs of the model before it can tokenize: where it is and the
    engine config every replica runs with (max_model_len resolved)."""

    path: str
    engine: Any          # pd_cluster.config.EngineConfig


class ReplicaTable:
    """A router's handles to the engine replicas of one membership, by role and replica id,
    and which of them it may send new work to: READY in the membership, and not found dead
    by this router since (it often notices a death before the controller does)."""

    def __init__(self) -> None:
        # By replica id: ids are not dense once the planner adds, removes or flips replicas.
        self.actors: dict[Role, dict[int, Any]] = {role: {} for role in Role}
        self.membership: Membership | None = None
        self._ids: dict[Key, str] = {}
        self._usable: set[Key] = set()
        self._dead_ids: set[str] = set()

    def update(self, membership: Membership) -> bool:
        """Take a newer membership; False (nothing done) if it is not newer."""
        if not membership.newer_than(self.membership):
            return False
        self.membership = membership
        self.actors = {role: {} for role in Role}
        self._usable = set()
        for m in membership.members:
            if m.actor is not None and m.state in (ReplicaState.READY, ReplicaState.DRAINING):
                self.actors[m.role][m.replica_id] = m.actor
                self._ids[m.key] = m.actor_id
            if m.state is ReplicaState.READY and m.actor_id not in self._dead_ids:
                self._usable.add(m.key)
        return True

    def mark_dead(self, key: Key) -> None:
        self._usable.discard(key)
        if key in self._ids:
            self._dead_ids.add(self._ids[key])

    def usable(self, key: Key) -> bool:
        return key in self._usable

    @property
    def dead(self) -> set[Key]:
        """Replicas whose current actor this router found dead (until a new one replaces it)."""
        return {key for key, actor_id in self._ids.items() if actor_id in self._dead_ids}

    def available(self) -> set[Key]:
        return set(self._usable)

    def live(self, role: Role, exclude: int | None = None) -> list[int]:
        return sorted(i for r, i in self._usable if r == role and i != exclude)

    def by_id(self, role: Role) -> list[Any]:
        """The actors of `role` this membership holds (READY or DRAINING), by replica id."""
        return [a for _, a in sorted(self.actors[role].items())]

    def keyed(self) -> list[tuple[Key, Any]]:
        """(key, handle) of every usable replica: prefill ones first, by replica id."""
        return [((r, i), self.actors[r][i])
                for r, i in sorted(self._usable, key=lambda k: (k[0] != Role.PREFILL, k[1]))]
