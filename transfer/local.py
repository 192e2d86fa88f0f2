"""In-process transport for tests: peers are other LocalTransports in this process.

Copies are synchronous torch copies; messages go straight into the peer's inbox. It exercises
the whole protocol (leases, notices, aborts) without any network or Ray.
"""
from __future__ import annotations

import weakref
from collections import deque

from transfer.base import KVTransport, Role, Transfer
from transfer.messages import Message, MsgKind, KVDescriptor
from transfer.runs import Copy

# name → transport; weak, so a transport that goes away looks like a dead peer.
_AGENTS: "weakref.WeakValueDictionary[str, LocalTransport]" = weakref.WeakValueDictionary()


class LocalTransport(KVTransport):
    backend = "local"

    def _register(self) -> None:
        self._inbox: deque[bytes] = deque()
        _AGENTS[self.name] = self

    def _address(self) -> bytes:
        return b""

    def _connect(self, peer: KVDescriptor) -> None:
        self._peer(peer.agent)

    def _peer(self, name: str) -> "LocalTransport":
        peer = _AGENTS.get(name)
        if peer is None:
            raise ConnectionError(f"local peer {name} is gone")
        return peer

    def _post(self, t: Transfer, copies: list[Copy]) -> None:
        peer = self._peer(t.peer)
        for local, remote, n in copies:
            mine, theirs = self._slice(local, n), peer._slice(remote, n)
            if t.role is Role.WRITE:
                theirs.copy_(mine)
            else:
                mine.copy_(theirs)
        t.handle = "done"
        self._send(t.peer, Message(MsgKind.DONE, t.id, self.name))

    def _check(self, t: Transfer) -> str | None:
        return "" if t.handle == "done" else None

    def _cancel(self, t: Transfer) -> None:
        t.handle = "cancelled"

    def _send(self, peer: str, msg: Message) -> None:
        self._peer(peer)._inbox.append(msg.encode())

    def _recv(self) -> list[bytes]:
        msgs = list(self._inbox)
        self._inbox.clear()
        return msgs

    def _close(self) -> None:
        _AGENTS.pop(self.name, None)
