"""The KV handoff: how a prompt's KV gets from the prefill engine (P) to the decode engine (D).

One strategy per deployment, chosen once from the mode, in three parts by who holds them:

    KVHandoff   the engine controller's and the routers' part, the same on every copy: it joins
                engine actors to the handoff, tells P where a prompt's KV goes, takes P's
                result for D, and ends what an attempt left outside the engines
    KVSender    P's part, which `KVHandoff.open_prefill` makes on a prefill engine's actor: it
                runs a prompt's prefill and hands the prompt's KV over
    KVReceiver  D's part, which `KVHandoff.open_decode` makes on a decode engine's actor: it
                takes a prompt's KV into the blocks D reserved

    PushHandoff (mode `disaggregated`): after each layer P writes that layer's blocks into
        blocks D reserved, so the transfer overlaps the next layer (actors/kv_push.py); D
        waits for the writes.
    PoolHandoff (mode `pooled`, actors/pool_handoff.py): after the prefill P puts the prompt's
        blocks into the KV pool, held there for D under the attempt id; D reads the blocks
        it lacks and ends the hold. P and D never address each other.

Lifecycle: the engine controller makes the KVHandoff and `join`s every engine actor to it as
the actor becomes ready (again when a restarted one does, or one that changed roles): the
actor gets a copy (`open_handoff`) and opens its role's part on its KVEndpoint, which it keeps
until it changes roles. Router replicas get a copy with the membership. Then, for each
attempt at a request (the whole exchange: router/disagg_client.py):
    router  destination(reservation)               what P.prefill is told of where the KV goes
    P       sender.send(id, prompt, destination, prefill) → runs the prefill, hands the KV over
    router  accept(id, result, reservation)        the result for D.decode; None: D prefills it
    D       receiver.receive(id, reservation, result) → once the KV is in D's reserved blocks
    router  release(id)                            ends what the attempt left outside the engines
    P       sender.abort(id)                       stops handing over an aborted request's KV
A failed handover raises in `send` (P) or `receive` (D); the caller frees the engine's side.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from actors.engine_loop import EngineLoop
from actors.kv_push import KVPusher, expect_transfers, quarantine_late_writes
from actors.messages import KVDestination, PooledKV, PrefillResult, PushedKV, ReplicaLoad
from actors.transport_pump import TransportPump
from pd_cluster.kv_layout import KVLayout
from pd_cluster.outputs import RequestOutput
from transfer.state import LEASE_S
from transfer.messages import KVDescriptor
from transfer.peers import seat_name
from transfer.registry import make_transport

Prefill = Callable[[], Awaitable[RequestOutput]]   # runs a prompt's prefill: its last output


class KVEndpoint:
    """An engine actor's end of the handoff: its engine loop, a transport registered over the
    engine's KV cache (every tensor-parallel rank's shard of it, mapped into this process;
    owned by a TransportPump), and the KV it has moved.

    The transport sits in the replica's seat (`name`: its role and replica id at start), so
    that when a replica restarts, its peers' transports replace the dead incarnation by the
    new one (transfer/peers.py) instead of keeping both. A replica that changes roles keeps
    the seat it started in: the fleet never gives its old replica id to another."""

    def __init__(self, loop: EngineLoop, transport: str, timeout_s: float, name: str,
                 lease_s: float = LEASE_S) -> None:
        tr = make_transport(transport, seat_name(name), timeout_s=timeout_s, lease_s=lease_s)
        tr.register_shards(loop.engine.kv_shards())
        self.loop, self.timeout_s = loop, timeout_s
        self.descriptor = tr.descriptor()
        self.encoded_descriptor = self.descriptor.encode()
        self.pump = TransportPump(tr, name=name)
        self.kv_bytes, self.transfer_s = 0, 0.0

    @property
    def layout(self) -> KVLayout:
        return self.descriptor.layout

    def bytes_of(self, num_blocks: int) -> int:
        """Bytes of `num_blocks` blocks, every layer's K and V (or latent)."""
        return num_blocks * self.layout.bytes_per_block_id

    async def connect(self, descriptor: bytes) -> str:
        """Open a channel to a peer's KV cache unless the transport has it (it drops a peer
        that failed or restarted: a later descriptor connects it again, or its successor);
        returns the peer's agent name."""
        peer = KVDescriptor.decode(descriptor)
        # Read off the pump's thread: one dict lookup, which saves each request a pump call.
        known = self.pump.transport.peers.get(peer.agent)
        if known is None or known.address != peer.address:
            await asyncio.wrap_future(self.pump.call(lambda tr: tr.connect(peer)))
        return peer.agent

    async def connect_all(self, descriptors: Sequence[bytes]) -> None:
        for descriptor in descriptors:
            await self.connect(descriptor)

    def count(self, nbytes: int, seconds: float) -> None:
        """KV moved: `nbytes` in `seconds`, for the load report."""
        self.kv_bytes += nbytes
        self.transfer_s += seconds

    def load(self, prefix_since: int | None = None) -> ReplicaLoad:
        """The engine's load report, with the KV this end has moved (and the prefix cache's
        changes after `prefix_since`, see EngineLoop.load)."""
        return dataclasses.replace(self.loop.load(prefix_since),
                                   kv_bytes_transferred=self.kv_bytes,
                                   kv_transfer_seconds=self.transfer_s,
                                   transport=self.descriptor.backend)


@dataclass(frozen=True, slots=True)
class Handover:
    """What P's part of a handoff did with one prompt."""

    last: RequestOutput         # the prefill's last output (the first token's)
    kv: PushedKV | PooledKV     # where the prompt KV is now
    kv_bytes: int               # bytes moved
    prefilled: float            # monotonic: the prefill was done
    started: float              # monotonic: the handover began (push: once D's blocks were known)


class KVSender(ABC):
    """P's part of a handoff (see the module docstring), on the prefill engine's KVEndpoint."""

    def __init__(self, end: KVEndpoint) -> None:
        self.end = end

    @abstractmethod
    async def send(self, request_id: str, prompt_ids: list[int], destination: list | None,
                   prefill: Prefill, salt: str | None = None) -> Handover:
        """Run `prefill` (its KV blocks stay held) and hand the prompt's KV over;
        `destination`: what the router's KVHandoff said of where it goes; `salt`: the
        request's cache salt (block hashes: pd_cluster/block_allocator.py salt_root)."""

    def abort(self, request_id: str) -> None:
        """Stop handing over the request's KV (it was aborted)."""

    def timeline(self) -> list[tuple[str, int, float]]:
        """Per-layer ("computed" | "posted", layer, time) marks of a layer-wise handover."""
        return []

    def close(self) -> None:
        """The engine stops serving P (it changes roles, idle)."""


class KVReceiver(ABC):
    """D's part of a handoff (see the module docstring), on the decode engine's KVEndpoint."""

    def __init__(self, end: KVEndpoint) -> None:
        self.end = end

    async def prefetch(self, prompt_ids: list[int],
                       salt: str | None = None) -> Callable[[], None]:
        """D is about to prefill a prompt itself: first make what it can of the prompt's KV a
        prefix-cache hit there (pool: the blocks a KV pool holds under the same cache salt).
        Returns what lets those blocks go, to call once the request is queued in the
        engine."""
        return lambda: None

    @abstractmethod
    async def receive(self, request_id: str, reservation: KVDestination,
                      result: PrefillResult) -> None:
        """Return once the prompt KV of `result` is in D's reserved blocks; raise if it
        cannot be."""


class KVHandoff(ABC):
    """The engine controller's and the routers' part of a handoff (see the module docstring):
    settings and shared resources only, the same on every copy; the engine actors open
    their parts from it."""

    @abstractmethod
    async def join(self, actor: Any, descriptor: bytes, peers: Sequence[tuple[Any, bytes]]
                   ) -> None:
        """Open the handoff on an engine actor that has just loaded its model (`open_handoff`);
        `descriptor`: its encoded KVDescriptor; `peers`: the ready replicas of the other role
        as (actor, descriptor). Replicas join one at a time, in any order, and again after
        a restart (the EngineFleet, router/control/fleet.py, calls this)."""

    @abstractmethod
    def destination(self, reservation: Any) -> list | None:
        """What P.prefill is told of where the KV goes; `reservation`: D.reserve's ObjectRef."""

    async def accept(self, attempt_id: str, result: PrefillResult,
                     reservation: Any) -> PrefillResult | None:
        """The result D decodes from, or None when D should prefill the prompt itself."""
        return result

    def release(self, attempt_id: str) -> None:
        """End what the attempt left outside the engines (fire and forget)."""

    @abstractmethod
    async def open_prefill(self, end: KVEndpoint, peers: list[bytes]) -> KVSender:
        """On a prefill engine's actor: its part; `peers`: the decode engines' KV
        descriptors (push only)."""

    @abstractmethod
    async def open_decode(self, end: KVEndpoint, peers: list[bytes]) -> KVReceiver:
        """On a decode engine's actor: its part; `peers`: the prefill engines' KV
        descriptors (push only)."""


Part = TypeVar("Part", KVSender, KVReceiver)


def opened(part: Part | None) -> Part:
    """An engine actor's part of the handoff, once the controller has opened it there."""
    if part is None:
        raise RuntimeError("no KV handoff yet: the controller opens one when the replica joins")
    return part


class PushSender(KVSender):
    """P's part of the push: the engine's KVPusher writes each layer's blocks as it is computed
    (actors/kv_push.py)."""

    def __init__(self, end: KVEndpoint) -> None:
        super().__init__(end)
        self.pusher = KVPusher(end.pump, end.layout.block_size, end.loop.engine.runner.device)
        end.loop.listener = self.pusher

    async def send(self, request_id: str, prompt_ids: list[int], destination: list | None,
                   prefill: Prefill, salt: str | None = None) -> Handover:
        end = self.end
        self.pusher.add(request_id)
        reserved = asyncio.ensure_future(self._reserved(request_id, destination[0]))
        ok = False
        try:
            last = await prefill()
            prefilled = time.monotonic()
            dest = await asyncio.wait_for(reserved, end.timeout_s)
            started = time.monotonic()
            ids = await asyncio.wait_for(asyncio.wrap_future(self.pusher.finish(request_id)),
                                         end.timeout_s)
            ok = True
        finally:
            if not ok:
                reserved.cancel()
                self.pusher.abort(request_id)
        bs = end.layout.block_size
        sent_blocks = -(-len(prompt_ids) // bs) - dest.num_cached_tokens // bs
        return Handover(last, PushedKV(end.encoded_descriptor, end.descriptor.agent, ids),
                        end.bytes_of(sent_blocks), prefilled, started)

    async def _reserved(self, request_id: str, ref: Any) -> KVDestination:
        """D's reservation, once it resolves: the writes waiting for it go out."""
        dest = await ref
        if dest is None:
            raise RuntimeError(f"{request_id}: the decode replica had no room to reserve KV")
        await self.end.connect(dest.descriptor)
        self.pusher.set_destination(request_id, dest.agent, dest.block_ids,
                                    dest.num_cached_tokens)
        return dest

    def abort(self, request_id: str) -> None:
        self.pusher.abort(request_id)

    def timeline(self) -> list[tuple[str, int, float]]:
        return list(self.pusher.timeline)

    def close(self) -> None:
        if self.end.loop.listener is self.pusher:
            self.end.loop.listener = None


class PushReceiver(KVReceiver):
    """D's part of the push: waits for P's writes into the reserved blocks to land."""

    async def receive(self, request_id: str, reservation: KVDestination,
                      result: PrefillResult) -> None:
        end, kv = self.end, result.kv
        agent = await end.connect(kv.descriptor)
        await asyncio.wait_for(asyncio.wrap_future(
            expect_transfers(end.pump, agent, kv.transfer_ids)), end.timeout_s)
        end.count(result.kv_bytes, result.transfer_s)


class PushHandoff(KVHandoff):
    """Layer-wise writes from P into D's reserved blocks (actors/kv_push.py)."""

    sender_type: type[PushSender] = PushSender
    receiver_type: type[PushReceiver] = PushReceiver

    async def join(self, actor: Any, descriptor: bytes, peers: Sequence[tuple[Any, bytes]]
                   ) -> None:
        # Both ways: two-sided transports (ucx, ray) acknowledge each write, and control
        # messages (leases, aborts) flow back too.
        await actor.open_handoff.remote(self, [d for _, d in peers])
        await asyncio.gather(*[peer.add_peer.remote(descriptor) for peer, _ in peers])

    def destination(self, reservation: Any) -> list:
        # In a list, so the ref reaches P unresolved: P starts while D still reserves.
        return [reservation]

    async def open_prefill(self, end: KVEndpoint, peers: list[bytes]) -> PushSender:
        sender = self.sender_type(end)
        await end.connect_all(peers)
        return sender

    async def open_decode(self, end: KVEndpoint, peers: list[bytes]) -> PushReceiver:
        await quarantine_late_writes(end.loop, end.pump)   # P's writes may outlive a request
        await end.connect_all(peers)
        return self.receiver_type(end)
