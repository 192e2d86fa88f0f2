"""Ray object-store transport: the universal fallback (any node, any device, no RDMA).

Ray has no one-sided access to another process's memory, so each transport owns a small
mailbox actor and both sides progress:

    write: put(our runs) → peer mailbox: DATA(runs, ref) → peer copies in → our mailbox: ACK
    read:  peer mailbox: READ_REQ(runs) → peer puts its runs → our mailbox: DATA(ref) → copy in

Host payloads are lists of numpy views: `ray.put` copies them into the object store once and
`ray.get` on the same node returns read-only zero-copy views, so a host hop is two memcpys.
The mailbox belongs to its transport's process, so when that process dies, deliveries to it
fail, which is how the peer learns of the death; a restarted peer's new mailbox replaces it
(transfer/peers.py).

The owner keeps one drain call open: the mailbox answers it at the first delivery, or after
DRAIN_WAIT_S with nothing, and `progress()` only checks whether the answer is in (no call, no
wait). Asking the mailbox afresh on every progress, as it once did, was an actor call per pump
tick: an idle engine's process used 0.27 of a core and the local Ray's processes 0.52 in all
(0.04 without the engine), now 0.10 and 0.16 (bench/idle_cpu.py;
bench/results/idle_cpu_{before,after}_cpu2.json).
"""
from __future__ import annotations

import asyncio
import bisect
import uuid
import warnings

import numpy as np
import ray
import torch

from transfer.base import KVTransport, Role, Transfer
from transfer.messages import Message, MessageError, MsgKind, KVDescriptor
from transfer.runs import Copy

_DONE = "done"


DRAIN_WAIT_S = 0.1     # how long an open drain waits for a delivery before answering empty


@ray.remote(num_cpus=0)
class _Mailbox:
    """A transport's inbox: peers deliver (message, payload refs); the owner drains. An async
    actor, so that deliveries run while a drain waits for them. Ray does not keep an async
    actor's tasks in their submission order, so each sender numbers its deliveries and the
    mailbox releases them in that order (the protocol assumes a sender's messages arrive in
    the order sent)."""

    def __init__(self) -> None:
        self.queue: list[tuple[bytes, list]] = []
        self.arrived = asyncio.Event()
        self.next: dict[str, int] = {}                          # sender -> next number due
        self.early: dict[tuple[str, int], tuple[bytes, list]] = {}

    async def deliver(self, sender: str, number: int, msg: bytes, refs: list) -> None:
        # refs nested in a list stay refs (not fetched here)
        self.early[sender, number] = (msg, refs)
        due = self.next.get(sender, 0)
        while (sender, due) in self.early:
            self.queue.append(self.early.pop((sender, due)))
            due += 1
        self.next[sender] = due
        if self.queue:
            self.arrived.set()

    async def drain(self, wait_s: float) -> list[tuple[bytes, list]]:
        """Everything delivered so far; if nothing is, the first delivery within wait_s."""
        if not self.queue:
            try:
                await asyncio.wait_for(self.arrived.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        self.arrived.clear()
        queue, self.queue = self.queue, []
        return queue


class RayTransport(KVTransport):
    backend = "ray"

    def __init__(self, name: str | None = None, **kwargs):
        super().__init__(name, **kwargs)
        self._mailbox = None
        self._drain: ray.ObjectRef | None = None          # our open drain call (module docstring)
        # Our deliveries' numbers per peer mailbox (a peer's new one counts from 0), under a
        # key of this instance's own (a transport that comes back under the same name starts
        # again from 0).
        self._sender = f"{self.name}/{uuid.uuid4().hex[:8]}"
        self._sent: dict[bytes, int] = {}
        self._mailboxes: dict[str, ray.actor.ActorHandle] = {}
        self._refs: dict[str, list] = {}                 # transfer id → payload refs received
        self._sends: list[tuple[str, ray.ObjectRef]] = []  # deliveries not yet confirmed
        self._dead: dict[str, str] = {}                  # peer → why we think it died
        self._errors: dict[str, str] = {}                # our transfer id → why it failed

    def _register(self) -> None:
        ns = ray.get_runtime_context().namespace
        self._mailbox_name = f"{ns}/pdkv-mailbox-{self.name}"
        self._mailbox = _Mailbox.options(name=f"pdkv-mailbox-{self.name}", namespace=ns).remote()
        # Host shards as flat numpy arrays (zero-copy), where payloads come from and go.
        self._host = None if self.kv.is_cuda else [f.numpy() for f in self._flat]

    def _address(self) -> bytes:
        return self._mailbox_name.encode()

    def _connect(self, peer: KVDescriptor) -> None:
        ns, _, name = peer.address.decode().partition("/")
        self._mailboxes[peer.agent] = ray.get_actor(name, namespace=ns)
        self._dead.pop(peer.agent, None)   # (a failed delivery to what this replaces)

    def _disconnect(self, peer: str) -> None:
        self._mailboxes.pop(peer, None)
        self._dead.pop(peer, None)

    def _post(self, t: Transfer, copies: list[Copy]) -> None:
        if t.role is Role.WRITE:
            t.handle = ray.put([self._view(off, n) for off, _, n in copies])
            self._deliver(t.peer, Message(MsgKind.DATA, t.id, self.name,
                                          runs=tuple((r, n) for _, r, n in copies)), [t.handle])
        else:
            t.handle = [(off, n) for off, _, n in copies]
            self._deliver(t.peer, Message(MsgKind.READ_REQ, t.id, self.name,
                                          runs=tuple((r, n) for _, r, n in copies)), [])

    def _check(self, t: Transfer) -> str | None:
        if t.handle is _DONE:
            return ""
        return self._errors.pop(t.id, None) or self._dead.get(t.peer)

    def _cancel(self, t: Transfer) -> None:
        t.handle = None  # drops our reference to the payload

    def _send(self, peer: str, msg: Message) -> None:
        self._deliver(peer, msg, [])

    def _deliver(self, peer: str, msg: Message, refs: list) -> None:
        mailbox, key = self._mailboxes[peer], self.peers[peer].address
        number = self._sent.get(key, 0)
        self._sent[key] = number + 1
        self._sends.append((peer, mailbox.deliver.remote(
            self._sender, number, msg.encode(), refs)))

    def _recv(self) -> list[bytes]:
        self._note_failed_deliveries()
        if self._drain is None:
            self._drain = self._mailbox.drain.remote(DRAIN_WAIT_S)
        if not ray.wait([self._drain], timeout=0)[0]:
            return []
        delivered = ray.get(self._drain, timeout=self.timeout_s)     # in: returns at once
        self._drain = self._mailbox.drain.remote(DRAIN_WAIT_S)
        out = []
        for raw, refs in delivered:
            if refs:
                try:
                    self._refs[Message.decode(raw).transfer_id] = refs
                except MessageError:
                    continue
            out.append(raw)
        return out

    def _note_failed_deliveries(self) -> None:
        if not self._sends:
            return
        refs = [r for _, r in self._sends]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(ready)
        for peer, ref in self._sends:
            if ref in ready:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayError) as e:
                    self._dead[peer] = f"peer process died ({type(e).__name__})"
        self._sends = [(p, r) for p, r in self._sends if r not in ready]
        for peer in [p for p in self._dead if p in self.peers]:
            self._rejoin(peer, self._dead[peer])

    def _on_message(self, msg: Message) -> bool:
        mine = self._outgoing.get(msg.transfer_id)
        if msg.kind is MsgKind.ACK and mine is not None:
            mine.handle = _DONE
        elif msg.kind is MsgKind.DATA and mine is not None and mine.role is Role.READ:
            try:
                self._copy_in(mine.handle, self._refs.pop(msg.transfer_id, []))
                mine.handle = _DONE
            except ray.exceptions.RayError as e:
                self._errors[mine.id] = f"payload lost, peer process died? ({type(e).__name__})"
        elif msg.kind is MsgKind.DATA:
            self._receive_write(msg)
        elif msg.kind is MsgKind.READ_REQ:
            if msg.sender not in self._mailboxes:   # (a replaced peer: transfer/peers.py)
                raise MessageError(f"{msg.kind.value} from {msg.sender}, not a peer")
            self._check_runs(msg.runs)
            payload = ray.put([self._view(off, n) for off, n in msg.runs])
            self._deliver(msg.sender, Message(MsgKind.DATA, msg.transfer_id, self.name), [payload])
            # Our blocks are free to reuse once their bytes are in the object store.
            self._dispatch(Message(MsgKind.DONE, msg.transfer_id, msg.sender))
        else:
            return False
        return True

    def _receive_write(self, msg: Message) -> None:
        try:
            self._copy_in(msg.runs, self._refs.pop(msg.transfer_id, []))
        except ray.exceptions.RayError as e:
            self._dispatch(Message(MsgKind.ABORT, msg.transfer_id, msg.sender,
                                   f"payload lost, peer process died? ({type(e).__name__})"))
            return
        self._send_quiet(msg.sender, Message(MsgKind.ACK, msg.transfer_id, self.name))
        self._dispatch(Message(MsgKind.DONE, msg.transfer_id, msg.sender))

    def _view(self, off: int, n: int) -> np.ndarray:
        """Bytes [off, off + n) of our shards (virtual offsets, transfer/shards.py)."""
        if self._host is None:
            return self._slice(off, n).cpu().numpy()
        i = 0 if len(self._host) == 1 else bisect.bisect_right(self._starts, off) - 1
        rel = off - self._starts[i]
        return self._host[i][rel:rel + n]

    def _copy_in(self, runs, refs: list) -> None:
        arrays = ray.get(refs[0], timeout=self.timeout_s) if refs else []
        self._check_runs(runs)
        if len(arrays) != len(runs) or any(a.nbytes != n for a, (_, n) in zip(arrays, runs)):
            raise MessageError("payload does not match its runs")
        for (off, n), arr in zip(runs, arrays):
            if self._host is not None:
                self._view(off, n)[:] = arr
            else:
                with warnings.catch_warnings():  # read-only store views are only read here
                    warnings.simplefilter("ignore", UserWarning)
                    self._slice(off, n).copy_(torch.from_numpy(arr), non_blocking=True)

    def _close(self) -> None:
        if self._mailbox is not None:
            ray.kill(self._mailbox)
            self._mailbox = None
            self._drain = None
