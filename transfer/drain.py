"""Draining a group of abandoned writes: how the receiver learns that none of them can land.

A late write is a write the sender posted before giving up on it (an abort, a timeout, a
failed sibling) whose bytes land afterwards. Marking a transfer ABORTED does not stop bytes
already handed to NIXL or UCX, so the receiver must keep the blocks such writes target away
from any new owner (it fences them: pd_cluster/kv_cache_quarantine.py) until the sender says
that nothing more can arrive. Writes are grouped (one group per request: every transfer id of
the group is `member_id(group, ...)`), and the notice names the group.

Sender (`KVTransport.drain(peer, group, transfers)`), one `Drain` per group it is done with
(abandoned, or all landed: then the notice goes at once and spares the receiver a wait for
a reservation it drops before seeing the writes land):
    DRAINING  the running transfers are marked ABORTED (the peer is told), their backend
              operations left alone: releasing an in-flight NIXL handle does not unpost its
              writes, it only hides them from us
        ├──► DRAINED  every operation is DONE or ERR (`_quiet`): released, and the peer gets
        │             MsgKind.DRAINED(group)
        └──► GAVE_UP  still moving at the drain's deadline (the transport's timeout): released
                      without a notice, so the receiver's own deadline frees its blocks
Receiver: a DRAINED(group) is reported to the owner's listener (`KVTransport.on_drained`)
once the transport serves no receive of the group any more (two-sided backends land a write
with a receive the receiver posted itself), or dropped after the transport's timeout.
A sender that dies sends nothing: the receiver's fence ends at its deadline (lease + margin).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from transfer.messages import Message, MsgKind
from transfer.state import Transfer, TransferState

log = logging.getLogger(__name__)

SEP = "/"


def member_id(group: str, *parts: object) -> str:
    """A transfer id of `group` (e.g. "req-7/3/0": request req-7, step 3, layer 0)."""
    return SEP.join((group, *map(str, parts)))


def in_group(transfer_id: str, group: str) -> bool:
    return transfer_id.startswith(group + SEP)


class DrainState(Enum):
    DRAINING = "draining"
    DRAINED = "drained"
    GAVE_UP = "gave_up"


@dataclass(eq=False, slots=True)
class Drain:
    """The sender's abandoned writes of one group to one peer, until none can land."""

    peer: str
    group: str
    transfers: list[Transfer]
    deadline: float
    state: DrainState = DrainState.DRAINING


@dataclass(eq=False, slots=True)
class DrainedNotice:
    """A peer's DRAINED(group), held until our own receives of the group have ended."""

    group: str
    sender: str
    since: float


class Draining:
    """The draining half of KVTransport (transfer/base.py): `drain` and `on_drained`, and what
    `progress` does for them."""

    def __init__(self) -> None:
        super().__init__()
        # Our abandoned groups until their writes are quiet, and peers' DRAINED notices until
        # our receives of the group ended; the owner's listener.
        self._drains: dict[tuple[str, str], Drain] = {}
        self._drained_in: dict[str, DrainedNotice] = {}
        self._drained_listener: Callable[[str], None] | None = None

    def drain(self, peer: str, group: str, transfers: Sequence[Transfer]) -> None:
        """Hand over `transfers`, a group's writes to `peer` that their owner is done with
        (landed, or abandoned): the running ones end ABORTED (the peer is told), and once the
        backend can move none of their bytes any more they are released and the peer gets
        DRAINED(group). The transport owns them from here on."""
        for t in transfers:
            if not t.state.finished:
                # Not `abort`: its backend cancel would release a NIXL handle whose writes
                # are still posted, and then nothing here could tell when they landed.
                self._finish(t, TransferState.ABORTED, "abandoned by its owner")
                self._send_quiet(t.peer, Message(MsgKind.ABORT, t.id, self.name,
                                                 "abandoned by its owner"))
        key = (peer, group)
        old = self._drains.pop(key, None)
        ts = [*(old.transfers if old else ()), *transfers]
        self._drains[key] = Drain(peer, group, ts, time.monotonic() + self.timeout_s)
        self._settle_drains(time.monotonic())

    def on_drained(self, listener: Callable[[str], None] | None) -> None:
        """Call `listener(group)` (on the thread that progresses us) for each peer's DRAINED
        notice, once our own receives of that group have ended."""
        self._drained_listener = listener

    def _settle_drains(self, now: float) -> None:
        """Our drained groups: DRAINED to the peer once no write of the group can land."""
        for key, d in list(self._drains.items()):
            quiet = all(self._quiet(t) for t in d.transfers)
            if not quiet and now <= d.deadline:
                continue
            del self._drains[key]
            for t in d.transfers:
                self.release(t)
            if quiet:
                d.state = DrainState.DRAINED
                self._send_quiet(d.peer, Message(MsgKind.DRAINED, d.group, self.name))
            else:
                d.state = DrainState.GAVE_UP
                log.warning("%s: writes of %s to %s still moving after %gs; the peer's "
                            "deadline will free its blocks", self.name, d.group, d.peer,
                            self.timeout_s)

    def _report_drained(self, now: float) -> None:
        """Peers' DRAINED notices: to the owner once our receives of the group have ended."""
        for group, n in list(self._drained_in.items()):
            if self._serving(group):
                if now - n.since > self.timeout_s:
                    del self._drained_in[group]   # the owner's deadline frees the blocks
                continue
            del self._drained_in[group]
            if self._drained_listener is not None:
                try:
                    self._drained_listener(group)
                except Exception:  # noqa: BLE001 - the owner's bug must not stop progress
                    log.exception("%s: the DRAINED listener failed for %s", self.name, group)

    def _quiet(self, t: Transfer) -> bool:
        """Whether the backend can move no more bytes of `t` (its operations completed or
        failed). Synchronous backends are always quiet."""
        return True

    def _serving(self, group: str) -> bool:
        """Whether a peer's transfer of `group` still lands through a receive we posted
        (two-sided backends)."""
        return False
