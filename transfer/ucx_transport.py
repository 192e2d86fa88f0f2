"""UCX transport over ucxx (the maintained successor of ucx-py): tagged sends between KV caches.

ucxx's Python API has tag/AM/stream messaging but no RMA, so transfers are two-sided; each
run travels straight from one KV cache's memory into the other's (no staging copy):

    write: control DATA(runs, tag) → tag_send(run i, tag+i)   peer: tag_recv(run i) → ACK
    read:  tag_recv(run i, tag+i) posted → control READ_REQ(runs, tag) → peer: tag_send(run i)

Control messages are length-prefixed frames on tag 1. Both sides must connect() to each other.
Endpoints are created with error handling, so a dead peer fails its requests instead of
hanging them; a peer that restarted, or whose endpoint broke, gets a new one (transfer/peers.py).
The worker's progress thread waits on epoll (a polling one would eat a core).
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import ucxx._lib.libucxx as ucx_api
from ucxx._lib.arr import Array

from transfer.base import KVTransport, Role, Transfer
from transfer.drain import in_group
from transfer.messages import Message, MessageError, MsgKind, KVDescriptor
from transfer.runs import Copy

_CTRL_TAG = 1
# A DATA / READ_REQ frame lists its runs (about 12 bytes each): head slices between KV caches
# of different tensor-parallel shardings are one run per token and head window, so a prompt's
# write can list tens of thousands.
_CTRL_BYTES = 1 << 22
_RUN_BITS = 24   # of a data tag: the run's index within its transfer (the rest: the transfer)
_DONE = "done"


class UcxTransport(KVTransport):
    backend = "ucx"

    def __init__(self, name: str | None = None, **kwargs):
        super().__init__(name, **kwargs)
        self._worker = ucx_api.UCXWorker(ucx_api.UCXContext({}))
        self._worker.start_progress_thread(polling_mode=False)
        self._eps: dict[str, ucx_api.UCXEndpoint] = {}
        self._ctrl_buf = np.empty(_CTRL_BYTES, np.uint8)
        self._ctrl_req = None
        self._sends: list[tuple[ucx_api.UCXRequest, np.ndarray]] = []  # control frames in flight
        # A peer's transfer we serve: transfer id → (peer, DATA or READ_REQ, data requests)
        self._served: dict[str, tuple[str, MsgKind, list]] = {}
        self._orphans: list = []  # requests of cancelled transfers, kept alive until they end
        self._dropped: list[ucx_api.UCXEndpoint] = []   # endpoints of peers dropped (_disconnect)

    def _register(self) -> None:
        self._repost_ctrl()

    def _address(self) -> bytes:
        return self._worker.address.tobytes()

    def _connect(self, peer: KVDescriptor) -> None:
        addr = ucx_api.UCXAddress.create_from_buffer(np.frombuffer(peer.address, np.uint8))
        self._eps[peer.agent] = ucx_api.UCXEndpoint.create_from_worker_address(
            self._worker, addr, True)

    def _disconnect(self, peer: str) -> None:
        # Kept, not closed: closing an endpoint that UCX already closed on the peer's death
        # crashes the process, and so may the last reference going on some other thread.
        self._dropped.append(self._eps.pop(peer))

    def _post(self, t: Transfer, copies: list[Copy]) -> None:
        tag, ep = self._tag(t.id), self._eps[t.peer]
        if len(copies) >= 1 << _RUN_BITS:
            raise ValueError(f"{len(copies)} runs: more than a transfer's tags can number")
        runs = tuple((r, n) for _, r, n in copies)
        if t.role is Role.WRITE:
            self._send(t.peer, Message(MsgKind.DATA, t.id, self.name, runs=runs, tag=tag))
            t.handle = [ep.tag_send(self._array(off, n), ucx_api.UCXXTag(tag + i))
                        for i, (off, _, n) in enumerate(copies)]
        else:
            t.handle = [self._worker.tag_recv(self._array(off, n), ucx_api.UCXXTag(tag + i))
                        for i, (off, _, n) in enumerate(copies)]
            self._send(t.peer, Message(MsgKind.READ_REQ, t.id, self.name, runs=runs, tag=tag))

    def _check(self, t: Transfer) -> str | None:
        if t.handle is _DONE:
            return ""
        if not self._eps[t.peer].alive:
            return "UCX endpoint closed: the peer process died"
        err = _error(t.handle)
        if err or t.role is Role.WRITE:  # a write ends with the peer's ACK, not here
            return err
        return "" if all(r.completed for r in t.handle) else None

    def _cancel(self, t: Transfer) -> None:
        if isinstance(t.handle, list):
            self._orphans.extend(t.handle)
        t.handle = None

    def _quiet(self, t: Transfer) -> bool:
        # Every run's send completed or failed: its bytes left us (the peer's receive,
        # posted for our DATA before our DRAINED, takes them: `_serving` on its side).
        return not isinstance(t.handle, list) or all(r.completed for r in t.handle)

    def _serving(self, group: str) -> bool:
        return any(in_group(tid, group) for tid in self._served)

    def _send(self, peer: str, msg: Message) -> None:
        body = msg.encode()
        frame = np.frombuffer(struct.pack("<I", len(body)) + body, np.uint8).copy()
        self._sends.append((self._eps[peer].tag_send(Array(frame), ucx_api.UCXXTag(_CTRL_TAG)),
                            frame))

    def _recv(self) -> list[bytes]:
        self._sends = [(r, f) for r, f in self._sends if not r.completed]
        self._orphans = [r for r in self._orphans if not r.completed]
        out = []
        while self._ctrl_req.completed:
            if _error([self._ctrl_req]) is None:
                (n,) = struct.unpack_from("<I", self._ctrl_buf)
                out.append(bytes(self._ctrl_buf[4:4 + min(n, _CTRL_BYTES - 4)]))
            self._repost_ctrl()
        self._finish_served()
        return out

    def _finish_served(self) -> None:
        """Our side of a peer's transfer: all runs moved → DONE; a failed run → ABORT."""
        for tid, (peer, kind, reqs) in list(self._served.items()):
            err = _error(reqs)
            if err is None and not all(r.completed for r in reqs):
                continue
            del self._served[tid]
            if err:
                self._dispatch(Message(MsgKind.ABORT, tid, peer, f"UCX: {err}"))
                continue
            if kind is MsgKind.DATA:  # a write into us: the writer waits for this ACK
                self._send_quiet(peer, Message(MsgKind.ACK, tid, self.name))
            self._dispatch(Message(MsgKind.DONE, tid, peer))

    def _on_message(self, msg: Message) -> bool:
        mine = self._outgoing.get(msg.transfer_id)
        if msg.kind is MsgKind.ACK and mine is not None:
            mine.handle = _DONE
        elif msg.kind in (MsgKind.DATA, MsgKind.READ_REQ):
            self._check_runs(msg.runs)
            ep = self._eps.get(msg.sender)
            if ep is None:   # (a replaced incarnation of a peer: transfer/peers.py)
                raise MessageError(f"{msg.kind.value} from {msg.sender}, not a peer")
            if msg.kind is MsgKind.DATA:
                reqs = [self._worker.tag_recv(self._array(off, n), ucx_api.UCXXTag(msg.tag + i))
                        for i, (off, n) in enumerate(msg.runs)]
            else:
                reqs = [ep.tag_send(self._array(off, n), ucx_api.UCXXTag(msg.tag + i))
                        for i, (off, n) in enumerate(msg.runs)]
            self._served[msg.transfer_id] = (msg.sender, msg.kind, reqs)
        else:
            return False
        return True

    def _repost_ctrl(self) -> None:
        self._ctrl_req = self._worker.tag_recv(Array(self._ctrl_buf), ucx_api.UCXXTag(_CTRL_TAG))

    def _array(self, off: int, n: int) -> Array:
        view = self._slice(off, n)
        return Array(view if view.is_cuda else view.numpy())

    def _check_runs(self, runs) -> None:
        """Offsets come from a peer: never let them reach outside our KV cache's shards."""
        if len(runs) >= 1 << _RUN_BITS:
            raise MessageError(f"{len(runs)} runs: more than a transfer's tags can number")
        super()._check_runs(runs)

    @staticmethod
    def _tag(transfer_id: str) -> int:
        """Per-transfer tag base, low _RUN_BITS bits left for the run index; never the control
        tag."""
        h = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=(64 - _RUN_BITS) // 8)
                           .digest(), "big")
        return (h | 1) << _RUN_BITS

    def _close(self) -> None:
        self._worker.stop_progress_thread()
        self._eps.clear()
        self._dropped.clear()


def _error(reqs: list) -> str | None:
    for r in reqs:
        if r.completed:
            try:
                r.check_error()
            except Exception as e:  # noqa: BLE001 - ucxx raises one class per UCS status
                return f"{type(e).__name__}: {e}"
    return None
