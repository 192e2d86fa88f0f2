"""TierChanges: the EngineFleet's (router/control/fleet.py) changes to its tiers' sizes and
its engines' roles, made so that no request fails: the engine controller's planner
(router/control/planner_loop.py) and an operator's drain call them.

    drain(role, id)   DRAINING: routers stop sending it requests; once it runs and holds
                      nothing (or at the timeout) it is killed → RETIRED, and never restarted;
                      its tier's target shrinks by one
    add(role)         a new slot of a role (the next unused replica id) → spawned like any;
                      the target grows by one
    flip(role, id)    DRAINING until idle, then the actor changes roles (EngineActor.set_role,
                      its model kept loaded, its KV cache emptied) → RETIRED, and a new slot of
                      the other role adopts the same actor → STARTING → joins the KV handoff →
                      READY; the targets move by one. Still busy at the timeout: back to
                      READY, nothing changed
Replica ids are never reused: a router may still hold a retired replica's state.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from actors.messages import ReplicaLoad
from pd_cluster.role import Role
from router.control.membership import ReplicaState

logger = logging.getLogger("router.control.fleet")

DRAIN_GRACE_S = 2.0           # routers see a membership change within a long poll's wake-up
DRAIN_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class RoleChange:
    """One replica's change of roles, as `flip` made it."""

    old: tuple[Role, int]           # its slot before (RETIRED)
    new: tuple[Role, int]           # its slot after
    actor_id: str                   # the same actor in both
    idle: ReplicaLoad               # its report once drained (its prefix cache still full)
    switched: ReplicaLoad           # its report at the switch: its KV cache empty
    seconds: float                  # from drained to switched


class TierChanges:
    """Mixed into EngineFleet: uses its slots, targets, and its slot bookkeeping and state
    changes (`_new_slot`, `_next_id`, `_set`, `_spawn`, `_bring_up`, `_kill`)."""

    answer_timeout_s = 10.0       # the longest wait for one answer of an engine actor

    async def drain(self, role: Role, replica_id: int, timeout_s: float = 600.0) -> Membership:
        """Stop routing to a replica, wait until it runs and holds nothing (at most
        `timeout_s`), stop it: RETIRED. Its tier's target shrinks by one."""
        role = Role.parse(role)
        slot = self.slots[(role, replica_id)]
        if slot.state is not ReplicaState.RETIRED:
            self.targets[role] = max(0, self.targets.get(role, 0) - 1)
        await self._wait_idle(slot, "draining: no new requests", timeout_s)
        self._kill(slot)
        if slot.task is not None:
            slot.task.cancel()
        if slot.state is not ReplicaState.RETIRED:
            self._set(slot, ReplicaState.RETIRED, "drained and stopped")
        return self.membership()

    def add(self, role: Role) -> tuple[Role, int]:
        """A new replica of `role` (a new actor, placed by Ray: on a cluster with an
        autoscaler, a node is added when none has room); its tier's target grows by one."""
        role = Role.parse(role)
        slot = self._new_slot(role, dict(self.resources.get(role, {})))
        self._spawn(slot)
        return slot.key

    async def flip(self, role: Role, replica_id: int, timeout_s: float = 600.0
                   ) -> tuple[Role, int] | None:
        """Move a READY replica to the other role without reloading its model: routers stop
        sending it `role` work (DRAINING), it finishes what it has (at most `timeout_s`; a
        replica still busy then goes back to READY, and None is returned), it switches
        (EngineActor.set_role: its KV cache emptied) and its slot is RETIRED; a new slot of
        the other role adopts the same actor and joins the KV handoff like a started one.
        Returns the new slot's key."""
        role = Role.parse(role)
        slot = self.slots[(role, replica_id)]
        other = role.other
        new_id = self._next_id(other)
        idle = await self._wait_idle(slot, f"changing to {other}-{new_id}: no new "
                                     f"{role} requests", timeout_s)
        began = time.monotonic()
        if slot.state is not ReplicaState.DRAINING:
            return None                              # it died meanwhile: the supervisor has it
        try:
            if idle is None:
                raise RuntimeError(f"still busy after {timeout_s:g} s")
            switched = await asyncio.wait_for(slot.actor.set_role.remote(other, new_id),
                                              self.answer_timeout_s)
        except Exception as e:  # noqa: BLE001 - keep serving the old role
            logger.warning("engine replica %s did not change roles: %s", slot.name,
                           short_reason(e))
            self._set(slot, ReplicaState.READY, f"role change abandoned: {short_reason(e)}")
            return None
        new = self._new_slot(other, slot.resources, new_id)    # the actor's new slot
        new.actor, new.actor_id, new.load = slot.actor, slot.actor_id, switched
        new.spawned_at = time.monotonic()
        actor_id, slot.actor = slot.actor_id, None
        self.targets[role] = max(0, self.targets.get(role, 0) - 1)
        self._set(slot, ReplicaState.RETIRED, f"now {other}-{new_id} (same actor)")
        new.task = asyncio.get_running_loop().create_task(self._bring_up(new))
        self.role_changes.append(RoleChange(slot.key, new.key, actor_id, idle, switched,
                                            time.monotonic() - began))
        logger.info("engine replica %s is now %s (actor %s, model kept)", slot.name, new.name,
                    actor_id)
        return new.key

    async def _wait_idle(self, slot: Any, detail: str, timeout_s: float
                         ) -> ReplicaLoad | None:
        """DRAINING (routers stop sending it requests); its load report once it runs and
        holds nothing, None at `timeout_s` or if it stopped answering. Idleness counts only
        after DRAIN_GRACE_S, once every router has seen DRAINING (a request routed just before may
        not have arrived yet); held KV blocks count as work (a prefill whose KV is still on
        its way to D, a reservation on D). The replica's own report, not the health check's
        (an unsupervised fleet makes none)."""
        if slot.state is ReplicaState.READY:
            self._set(slot, ReplicaState.DRAINING, detail)
        began = time.monotonic()
        while slot.state is ReplicaState.DRAINING and time.monotonic() - began < timeout_s:
            try:
                load = await asyncio.wait_for(slot.actor.load.remote(), self.answer_timeout_s)
            except Exception:  # noqa: BLE001 - dead or unresponsive: nothing left to wait for
                return None
            if time.monotonic() - began >= DRAIN_GRACE_S and _idle(load):
                return load
            await asyncio.sleep(DRAIN_POLL_S)
        return None


def _idle(load: ReplicaLoad) -> bool:
    return load.num_running == load.num_waiting == load.kv_blocks_used == 0


def short_reason(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1][:300] if text else type(e).__name__
