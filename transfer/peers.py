"""A transport's peers coming and going: a replica that restarts is re-joined by its peers
without a restart of theirs (the PeerTable half of KVTransport, transfer/base.py).

A transport that fills a seat outliving its processes (an engine replica's: its role and
replica id) is named `seat_name(seat)`, "<seat>@<incarnation>": a restarted replica comes back
in the same seat under a new name, at a new address. `connect(descriptor)` then:
    a known agent at the same address      nothing to do
    a known agent at a new address         it re-registered under its name: the old metadata
                                           goes, the new is taken
    a new agent in a known agent's seat    the replica restarted: the old incarnation goes for
                                           good, the new one is taken. A late descriptor of the
                                           old one (a result it sent before it died) is not
                                           connected again: `connect` returns its name, and
                                           transfers with it lapse or fail
A backend error with a peer (a failed transfer, an undeliverable control message) drops the
peer's metadata too, since a UCX endpoint (NIXL's included) that gave up on a peer stays
failed even once the peer answers again, and connects it again at once from the descriptor
it gave: a new NIXL remote agent and prepared lists, a new UCX endpoint, the
mailbox looked up anew. Once per REJOIN_EVERY_S per peer, so that a dead peer costs one
attempt per second, not one per failed transfer.
Dropping a peer fails our open transfers to it (their backend handles go with it); its
transfers into us end by their leases. Backends free what they hold of a peer in `_disconnect`.
"""
from __future__ import annotations

import logging
import time
import uuid

from transfer.messages import KVDescriptor, Message
from transfer.shards import head_sources
from transfer.state import Transfer, TransferState

log = logging.getLogger(__name__)

SEAT_SEP = "@"
REJOIN_EVERY_S = 1.0


def seat_name(seat: str) -> str:
    """A transport name for an owner in `seat` (see the module docstring)."""
    return f"{seat}{SEAT_SEP}{uuid.uuid4().hex[:8]}"


def seat_of(agent: str) -> str | None:
    """The seat of a transport named by `seat_name`; None for any other name."""
    seat, sep, _ = agent.rpartition(SEAT_SEP)
    return seat if sep and seat else None


class PeerTable:
    """Which peers a transport is connected to, and how they are replaced (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._retired: set[str] = set()          # agents whose seat a newer incarnation took
        self._rejoined_at: dict[str, float] = {}

    def _admit(self, desc: KVDescriptor) -> bool:
        """Whether connect() opens a channel to `desc`, having dropped what it replaces."""
        if desc.agent in self._retired:
            log.info("%s: %s was replaced by a restart of its replica; not connected again",
                     self.name, desc.agent)
            return False
        known = self.peers.get(desc.agent)
        if known is not None:
            if known.address == desc.address:
                return False
            self.forget(desc.agent, "it re-registered at a new address")
        seat = seat_of(desc.agent)
        for agent in [a for a in self.peers if seat is not None and seat_of(a) == seat]:
            self.forget(agent, f"{desc.agent} took its seat (its replica restarted)")
            self._retired.add(agent)
        return True

    def _join(self, desc: KVDescriptor) -> None:
        mine, theirs = self.shard_layouts, desc.layouts
        routes = (head_sources(mine, theirs), head_sources(theirs, mine))
        self._connect(desc)
        self.peers[desc.agent] = desc
        self._routes[desc.agent] = routes

    def forget(self, peer: str, why: str) -> KVDescriptor | None:
        """Drop a peer: fail our open transfers to it, free the backend's hold on it (NIXL
        remote agent and lists, UCX endpoint, mailbox handle). Returns its descriptor."""
        desc = self.peers.pop(peer, None)
        if desc is None:
            return None
        self._routes.pop(peer, None)
        for t in [t for t in self._open_out.values() if t.peer == peer and not t.state.finished]:
            self._cancel(t)
            self._finish(t, TransferState.FAILED, f"peer {peer} dropped: {why}")
        try:
            self._disconnect(peer)
        except Exception:  # noqa: BLE001 - what a dead peer's backend state does on release
            log.exception("%s: freeing the backend's state of %s failed", self.name, peer)
        log.warning("%s: dropped peer %s: %s", self.name, peer, why)
        return desc

    def _rejoin(self, peer: str, why: str) -> None:
        """A backend error with `peer`: connect it anew from its descriptor (module docstring)."""
        now = time.monotonic()
        if peer not in self.peers or now - self._rejoined_at.get(peer, -REJOIN_EVERY_S) \
                < REJOIN_EVERY_S:
            return
        self._rejoined_at[peer] = now
        desc = self.forget(peer, why)
        try:
            self._join(desc)
        except Exception as e:  # noqa: BLE001 - e.g. a dead Ray mailbox: the next connect()
            log.warning("%s: could not connect %s again (%r); a new descriptor will", self.name,
                        peer, e)
            return
        log.warning("%s: connected %s again after: %s", self.name, peer, why)

    def _failed(self, t: Transfer, error: str) -> None:
        """The backend failed `t`: the channel to its peer may be broken for good."""
        self._finish(t, TransferState.FAILED, error)
        self._rejoin(t.peer, f"transfer {t.id} failed: {error}")

    def _undelivered(self, peer: str, msg: Message, error: Exception) -> None:
        log.info("%s: %s to %s not delivered: %r", self.name, msg.kind.value, peer, error)
        self._rejoin(peer, f"{msg.kind.value} not delivered: {error!r}")

    def _disconnect(self, peer: str) -> None:
        """Free what the backend holds of `peer` (connect() may add it again)."""
