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

from dataclasses import dataclass
from enum import Enum

from transfer.state import Transfer

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
