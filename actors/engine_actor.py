"""EngineActor: one engine replica of a disaggregated deployment, serving as P or as D, and
able to change roles without reloading its model.

Lifecycle of the actor (the engine controller drives it, router/control/fleet.py):
    __init__(config, role, id)  loads the model, starts the engine loop and a transport over
                                the engine's KV cache (KVEndpoint); serves `role`; with
                                `engine_lease_s` (a Serve application's detached engines),
                                holds a lease from then on (actors/engine_lease.py)
    renew_lease()               the controller's, every ENGINE_LEASE_RENEW_EVERY_S; without
                                one for the lease, the actor ends its own process
    open_handoff(handoff, peers) the controller opens the deployment's KV handoff on it: its
                                side opens its role's part (KVSender / KVReceiver: push, or
                                through the KV pool, actors/handoff.py)
    SERVING                     requests of its role (PrefillSide / DecodeSide); a call for
                                the other role raises WrongRole
    (controller: DRAINING)      routers send it nothing new; what it has runs to the end
    set_role(role, id)          only when idle (nothing running, waiting, reserved or held):
                                SWITCHING, the prefix cache dropped (the KV cache is empty),
                                the engine's per-role settings and its name in load reports
                                changed, the handoff closed → SERVING the new role, with no
                                handoff until the controller opens it again; the weights stay
                                loaded (`ReplicaLoad.model_loads` stays 1)
A colocated deployment's engines are ColocatedActors (actors/colocated_actor.py) instead.
"""
from __future__ import annotations

import enum
import time

import ray

from actors.decode_side import DecodeSide
from actors.engine_lease import EngineLease
from actors.engine_loop import EngineLoop
from actors.handoff import KVEndpoint, KVHandoff
from actors.kv_tier_engine import TieredEngine
from actors.messages import DecodeTimes, KVDestination, PrefillResult, ReplicaLoad
from actors.prefill_side import PrefillSide
from actors.streaming import StreamingEngine
from actors.transport_pump import ms_percentiles
from kernels import compiles
from pd_cluster.config import EngineConfig
from pd_cluster.engine import LLMEngine
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from transfer.state import LEASE_S


# The reservation lease: D holds a prompt's reserved KV blocks (DecodeSide.reserve) for
# RESERVATION_LEASE_S without a renewal (`renew`); the router renews it every
# RESERVATION_RENEW_EVERY_S while P prefills the prompt. Not the subscriber lease
# (actors/subscribers.py) nor the KV transport's (transfer/state.py).
RESERVATION_LEASE_S = 60.0
RESERVATION_RENEW_EVERY_S = 5.0     # well within the lease (router side)


class RoleState(str, enum.Enum):
    SERVING = "serving"
    SWITCHING = "switching"


class WrongRole(RuntimeError):
    """A call for the role this replica does not serve (it changed roles, or is changing)."""


@ray.remote
class EngineActor(StreamingEngine, TieredEngine):
    def __init__(self, config: EngineConfig, role: Role, replica_id: int, transport: str,
                 timeout_s: float = 120.0, lease_s: float = RESERVATION_LEASE_S,
                 transfer_lease_s: float = LEASE_S, engine_lease_s: float | None = None,
                 kv_tiers: object = None) -> None:
        """`lease_s`: how long D holds a reservation without a renewal; `transfer_lease_s`:
        the KV transport's lease (transfer/base.py), which also sets how long D fences blocks
        a dead P may still write; `engine_lease_s`: this actor's own lease (None: none, its
        owner's death ends it); `kv_tiers`: a KVTiersConfig to keep evicted prefix blocks in
        the node's host and disk tiers and load prompts' prefixes from them, as P before a
        prefill and as D before a reservation (actors/kv_tiers.py); None: off."""
        role = Role.parse(role)
        self.lease_s = lease_s
        self.loop = EngineLoop(config, timeout_s, role, replica_id)
        self._init_tiers(kv_tiers)
        self.async_scheduling = self.loop.engine.async_scheduling   # D's setting, resolved
        self._open_outbox()
        self.end = KVEndpoint(self.loop, transport, timeout_s, f"engine-{role}-{replica_id}-kv",
                              transfer_lease_s)
        self.state = RoleState.SERVING
        self.role_changes = 0
        self.side: PrefillSide | DecodeSide = self._side_for(role)
        if role is Role.PREFILL:
            self.loop.engine.async_scheduling = False   # before any request: no race
        self.lease = (None if engine_lease_s is None
                      else EngineLease(f"{role}-{replica_id}", engine_lease_s))

    @property
    def role(self) -> Role:
        return Role.PREFILL if isinstance(self.side, PrefillSide) else Role.DECODE

    def _side_for(self, role: Role) -> PrefillSide | DecodeSide:
        return PrefillSide(self) if role is Role.PREFILL else DecodeSide(self, self.lease_s)

    def _as(self, role: Role):
        if self.state is not RoleState.SERVING or self.role != role:
            raise WrongRole(f"engine replica {self.loop.role}-{self.loop.replica_id} serves "
                            f"{self.role} ({self.state}), not {role}")
        return self.side

    # -- either role ----------------------------------------------------------------------
    def kv_descriptor(self) -> bytes:
        """The encoded KVDescriptor of this engine's KV cache."""
        return self.end.encoded_descriptor

    async def open_handoff(self, handoff: KVHandoff, peers: list[bytes]) -> None:
        """Hand the KV of prompts over (P) or take it (D) this way from now on; `peers`: the
        other role's KV descriptors, for a handoff that addresses them."""
        await self.side.open(handoff, peers)

    async def handoff_open(self) -> bool:
        """Whether the controller has opened the handoff here (a controller that adopts
        this actor joins it only if not)."""
        side = self.side
        return (side.sender if isinstance(side, PrefillSide) else side.receiver) is not None

    async def renew_lease(self) -> float:
        """Renew this actor's lease (actors/engine_lease.py); returns its length."""
        return 0.0 if self.lease is None else self.lease.renew()

    async def add_peer(self, descriptor: bytes) -> None:
        """Connect to an engine of the other role that joined after us."""
        await self.end.connect(descriptor)

    async def abort(self, request_id: str) -> None:
        await self.side.abort(request_id)

    def _subscriber_gone(self, sub: str, request_ids: list[str]) -> None:
        """A router's lease expired: end what it left here (its prefills; its reservations
        and streams)."""
        self.side.subscriber_gone(sub, request_ids)
        self.outbox.close(sub)

    async def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """The engine's load report (see KVEndpoint.load, EngineLoop.load), with the KV
        tiers' counters when they are on."""
        return self._with_tiers(self.end.load(prefix_since))

    async def stage_times(self) -> list[tuple]:
        """Recent requests' stage times (PrefillSide.stages / DecodeSide.stages)."""
        return list(self.side.stages)

    async def diagnostics(self, since: float | None = None) -> dict:
        """The pump's command lag and slow iterations, and the engine's step durations; with
        `since` (monotonic), also the raw step log (began, ended, waiting, running) of the
        steps that began after it and the Triton kernels compiled since."""
        log = list(self.loop.step_log)
        out = {"pump": self.end.pump.stats(), "steps": len(log),
               **ms_percentiles("step", [b - a for a, b, *_ in log])}
        if since is not None:
            out["step_log"] = [row for row in log if row[0] >= since]
            out["kernel_compiles"] = compiles.since(since)
        return out

    # -- prefill (P) ----------------------------------------------------------------------
    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      destination: list | None, sub: str | None = None) -> PrefillResult:
        """See PrefillSide.prefill (the prompt's prefix first loaded from the KV tiers where
        that beats computing it, held until the prefill is done)."""
        side = self._as(Role.PREFILL)
        # Released before the prefill is queued, not after it ran (kv_tier_engine.py: why).
        self._tier_release(await self._tier_reuse(prompt_ids, params.cache_salt))
        return await side.prefill(request_id, prompt_ids, params, destination, sub)

    async def timeline(self) -> list[tuple[str, int, float]]:
        """See PrefillSide.timeline."""
        return self._as(Role.PREFILL).timeline()

    # -- decode (D) -----------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      sub: str | None = None) -> KVDestination | None:
        """See DecodeSide.reserve (the prompt's prefix first loaded from the KV tiers where
        that beats computing it: P then pushes only the rest)."""
        side = self._as(Role.DECODE)
        kept = await self._tier_reuse(prompt_ids, params.cache_salt)
        try:
            return await side.reserve(request_id, prompt_ids, params, sub)
        finally:
            self._tier_release(kept)     # the reservation holds them now

    async def renew(self, request_id: str) -> bool:
        """See DecodeSide.renew."""
        return await self._as(Role.DECODE).renew(request_id)

    async def decode(self, request_id: str, result: PrefillResult, sub: str,
                     first_sent: bool) -> DecodeTimes:
        """See DecodeSide.decode."""
        return await self._as(Role.DECODE).decode(request_id, result, sub, first_sent)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       sub: str, first_sent: bool = False) -> None:
        """D prefills a prompt itself (conditional disaggregation, the fallbacks): see
        DecodeSide.generate."""
        side = self._as(Role.DECODE)
        # Released before the request is queued (kv_tier_engine.py: why).
        self._tier_release(await self._tier_reuse(prompt_ids, params.cache_salt))
        await side.generate(request_id, prompt_ids, params, sub, first_sent)

    # -- changing roles ---------------------------------------------------------------------
    async def set_role(self, role: Role, replica_id: int) -> ReplicaLoad:
        """Serve `role` as replica `replica_id` from now on, keeping the model loaded (see
        the module docstring). Raises (and keeps serving as before) unless the engine is
        idle; returns the load report taken on the engine thread at the switch (nothing
        held, the prefix cache empty)."""
        role = Role.parse(role)
        if self.state is not RoleState.SERVING:
            raise RuntimeError(f"engine replica is already {self.state}")
        old, self.state = self.side, RoleState.SWITCHING
        began = time.monotonic()
        try:
            load = await self.loop.call(lambda e: self._switch(e, role, replica_id))
        except BaseException:
            self.state = RoleState.SERVING
            raise
        old.close()   # the handoff: the controller opens it anew
        self.side = old if role == self.role else self._side_for(role)
        self.role_changes += 1
        self.state = RoleState.SERVING
        self.switch_s = time.monotonic() - began
        return load

    def _switch(self, engine: LLMEngine, role: Role, replica_id: int) -> ReplicaLoad:
        """Engine thread, between steps: the commands queued before this one have run."""
        kv = engine.kv
        busy = engine.has_unfinished() or kv.num_free_blocks != kv.num_blocks
        if busy:
            raise RuntimeError(
                f"engine replica {self.loop.role}-{self.loop.replica_id} is not idle "
                f"({len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} "
                f"waiting, {kv.num_blocks - kv.num_free_blocks} KV blocks held): drain it "
                "before it changes roles")
        kv.allocator.reset_prefix_cache()        # the old role's cached prompts go
        if role is Role.PREFILL:
            PrefillSide.configure(engine)
        else:
            engine.async_scheduling = self.async_scheduling
        self.loop.role, self.loop.replica_id = role, replica_id
        self.loop.refresh()
        return self.loop.load()
