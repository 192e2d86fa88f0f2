"""The KV transport interface: one engine's paged KV cache ↔ a peer's, block by block.

Lifecycle of a transport:
    register(kv, layout) | register_shards([(kv, layout), ...])
        → descriptor() → connect(peer descriptor)   (once per peer, and its restarts: peers.py)
    initiator: write()/read() → poll()/wait() → release()
    target:    expect(transfer id) → poll() → release()   (its blocks are touched by the peer)

Lifecycle of one transfer (`TransferState`):
    IN_FLIGHT ──► DONE
        ├─────► FAILED      the backend reported an error (typically: the peer died)
        ├─────► TIMED_OUT   still running at its deadline
        ├─────► ABORTED     abort() on either side (the other side is told)
        └─────► EXPIRED     target only: the peer stopped renewing its lease on our blocks

The initiator renews the target's lease with RENEW messages while its transfer runs, and a
completion notice (DONE) reaches the target once the bytes have landed. Nothing here blocks
without a deadline, and every non-DONE end tells the owner to free its blocks.

An ended transfer's bytes may still be moving (an aborted write the backend had posted), so
an initiator done with a group of writes (all landed, or abandoned) `drain`s them, and the
target's owner learns through `on_drained` when none of them can land any more
(transfer/drain.py).

A KV cache may be several head-window shards (a tensor-parallel engine: one tensor per rank,
transfer/shards.py): a transfer moves, into every destination shard, the heads of its window
from the first source shard holding them, whatever the two sides' shardings. Byte offsets
(runs.Copy) count over the virtual concatenation of a side's shards.
"""
from __future__ import annotations

import bisect
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from pd_cluster.kv_layout import KVLayout
from transfer.drain import DrainedNotice, Draining
from transfer.messages import KVDescriptor, KVShard, Message, MessageError, MsgKind
from transfer.runs import Copy, shard_copies
from transfer.peers import PeerTable
from transfer.shards import Segment, check_shards, outside, starts
from transfer.state import (LEASE_S, LayoutMismatchError, Role, Transfer, TransferError,
                            TransferState)

__all__ = ["KVTransport", "LayoutMismatchError", "Role", "Transfer", "TransferError",
           "TransferState"]

log = logging.getLogger(__name__)


class KVTransport(PeerTable, Draining, ABC):
    """Moves (layer range × block ids) between registered KV caches; see the module docstring
    (and transfer/peers.py: peers that restart)."""

    backend: ClassVar[str]

    def __init__(self, name: str | None = None, *, timeout_s: float = 30.0,
                 lease_s: float = LEASE_S):
        super().__init__()
        self.name = name or f"{self.backend}-{uuid.uuid4().hex[:12]}"
        self.timeout_s, self.lease_s = timeout_s, lease_s
        # After register: the shards (tensors, their layouts, each one's first virtual byte and
        # the total), the first shard as `kv`, and `layout`: the whole KV cache, all heads.
        self.shards: tuple[torch.Tensor, ...] = ()
        self.shard_layouts: tuple[KVLayout, ...] = ()
        self._starts: list[int] = []
        self._flat: list[torch.Tensor] = []
        self.kv: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        # peer → head segments (transfer/shards.py) of our writes to it, of our reads from it
        self._routes: dict[str, tuple[list[Segment], list[Segment]]] = {}
        self.peers: dict[str, KVDescriptor] = {}
        self._outgoing: dict[str, Transfer] = {}
        self._targets: dict[str, Transfer] = {}
        # The unfinished ones of each, which progress() walks: owners release finished
        # transfers late (a prefill waits for all of a prompt's 32+ writes), and walking every
        # held one on each poll made the poll's cost grow with the backlog it should drain.
        self._open_out: dict[str, Transfer] = {}
        self._open_in: dict[str, Transfer] = {}
        # Messages that beat expect() (a fast peer), in arrival order (a late RENEW must not
        # hide the DONE): kept until expect() or the timeout.
        self._unclaimed: dict[str, tuple[float, list[Message]]] = {}

    # -- setup ---------------------------------------------------------------------------
    def register(self, kv: torch.Tensor, layout: KVLayout) -> None:
        """Register an unsharded KV cache: `register_shards([(kv, layout)])`."""
        self.register_shards([(kv, layout)])

    def register_shards(self, shards: Sequence[tuple[torch.Tensor, KVLayout]]) -> None:
        """Register a KV cache made of shards, [num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim] each (a TP engine's ranks, in rank order): the same blocks,
        a window of the model's KV heads each, every head in at least one, all in host
        memory or all on GPUs (one per shard, possibly different)."""
        why = check_shards([layout for _, layout in shards])
        if why:
            raise ValueError(f"not one KV cache: {why}")
        for kv, layout in shards:
            if tuple(kv.shape) != layout.shape or kv.dtype != layout.torch_dtype:
                raise ValueError(f"KV tensor {tuple(kv.shape)} {kv.dtype} does not match {layout}")
            if not kv.is_contiguous():
                raise ValueError("every KV cache shard must be one contiguous tensor")
        if len({kv.is_cuda for kv, _ in shards}) > 1:
            raise ValueError("KV cache shards must be all in host memory or all on GPUs")
        self.shards = tuple(kv for kv, _ in shards)
        self.shard_layouts = tuple(layout for _, layout in shards)
        self._starts = starts(self.shard_layouts).tolist()
        self._flat = [kv.view(-1).view(torch.uint8) for kv in self.shards]
        self.kv, self.layout = self.shards[0], self.shard_layouts[0].whole()
        self._register()

    def descriptor(self) -> KVDescriptor:
        self._registered()
        return KVDescriptor(self.backend, self.name,
                            tuple(KVShard(lay, kv.data_ptr(), kv.device.index or 0)
                                  for kv, lay in zip(self.shards, self.shard_layouts)),
                            self.kv.is_cuda, self._address())

    def connect(self, peer: KVDescriptor | bytes) -> str:
        """Check the peer's KV cache is compatible, open a channel to it (or replace the one
        to what it replaces: transfer/peers.py); returns its name."""
        desc = KVDescriptor.decode(peer) if isinstance(peer, bytes) else peer
        self._registered()
        if desc.backend != self.backend:
            raise LayoutMismatchError(
                f"peer {desc.agent} uses transport {desc.backend!r}, this one {self.backend!r}")
        why = self.layout.mismatch(desc.layout) or check_shards(desc.layouts)
        if why:
            raise LayoutMismatchError(f"cannot exchange KV blocks with {desc.agent}: {why}")
        if self._admit(desc):   # a known peer, or one a restart replaced: transfer/peers.py
            self._join(desc)
        return desc.agent

    # -- transfers -----------------------------------------------------------------------
    def write(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              layers: range | None = None, transfer_id: str | None = None) -> Transfer:
        """Start copying our `local_blocks` into the peer's `remote_blocks` (all layers by default)."""
        return self._start(Role.WRITE, peer, local_blocks, remote_blocks, layers, transfer_id)

    def read(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
             layers: range | None = None, transfer_id: str | None = None) -> Transfer:
        """Start copying the peer's `remote_blocks` into our `local_blocks`."""
        return self._start(Role.READ, peer, local_blocks, remote_blocks, layers, transfer_id)

    def expect(self, peer: str, transfer_id: str, lease_s: float | None = None) -> Transfer:
        """Track a peer's transfer into (or out of) our blocks; the peer must renew its lease."""
        now = time.monotonic()
        lease = lease_s or self.lease_s
        t = Transfer(transfer_id, peer, Role.TARGET, now + self.timeout_s, lease,
                     lease_until=now + lease)
        self._targets[transfer_id] = t
        self._open_in[transfer_id] = t
        for msg in self._unclaimed.pop(transfer_id, (0, []))[1]:
            self._apply(t, msg)
        return t

    def poll(self, t: Transfer) -> TransferState:
        self.progress()
        return t.state

    def wait(self, t: Transfer) -> None:
        """Poll until `t` ends (its deadline bounds this); raise TransferError unless DONE.

        Spins for the first 2 ms: a GPU transfer of a whole prompt takes about 1 ms, and
        even a short sleep would dominate it. Then backs off from 50 µs to 0.5 ms sleeps:
        longer ones (this was 5 ms) added up to 5 ms to every transfer of 2-50 ms, e.g. a
        prompt's KV into host memory, while a 0.5 ms poll costs nothing measurable.
        """
        spin_until, pause = time.monotonic() + 2e-3, 5e-5
        while not self.poll(t).finished:
            if time.monotonic() > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)
        t.raise_if_failed()

    def abort(self, t: Transfer, reason: str = "aborted by owner") -> None:
        """Stop `t` here and tell the peer, so both sides free their blocks."""
        if t.state.finished:
            return
        if t.role is not Role.TARGET:
            self._cancel(t)
        self._finish(t, TransferState.ABORTED, reason)
        self._send_quiet(t.peer, Message(MsgKind.ABORT, t.id, self.name, reason))

    def release(self, t: Transfer) -> None:
        """Forget `t` (aborting it if still running) and free its backend resources."""
        self.abort(t, "released while in flight")
        self._release(t)
        for table in ((self._targets, self._open_in) if t.role is Role.TARGET
                      else (self._outgoing, self._open_out)):
            if table.get(t.id) is t:
                del table[t.id]

    def in_flight(self) -> int:
        return sum(not t.state.finished for d in (self._outgoing, self._targets)
                   for t in d.values())

    def close(self) -> None:
        for t in [*self._outgoing.values(), *self._targets.values()]:
            self.release(t)
        self._close()

    # -- progress ------------------------------------------------------------------------
    def progress(self) -> None:
        """One non-blocking step: take in messages, advance transfers, enforce deadlines."""
        for raw in self._recv():
            try:
                self._dispatch(Message.decode(raw))
            except MessageError as e:
                log.warning("%s: dropped a message: %s", self.name, e)
        now = time.monotonic()
        for tid, t in list(self._open_out.items()):
            if not t.state.finished:
                self._advance(t, now)
            if t.state.finished:
                del self._open_out[tid]
        for tid, t in list(self._open_in.items()):
            if t.state.finished:
                del self._open_in[tid]
                continue
            if now > t.lease_until:
                self._end_target(t, TransferState.EXPIRED,
                                 f"peer {t.peer} stopped renewing its lease ({t.lease_s:g}s)")
            elif now > t.deadline:
                self._end_target(t, TransferState.TIMED_OUT,
                                 f"no completion from {t.peer} within {self.timeout_s:g}s")
        for tid, (seen, _) in list(self._unclaimed.items()):
            if now - seen > self.timeout_s:
                del self._unclaimed[tid]
        if self._drains:
            self._settle_drains(now)
        if self._drained_in:
            self._report_drained(now)

    def _advance(self, t: Transfer, now: float) -> None:
        err = self._check(t)
        if err == "":
            t.state = TransferState.DONE
        elif err is not None:
            self._failed(t, err)
        elif now > t.deadline:
            self.abort(t, f"timed out after {self.timeout_s:g}s")
            t.state = TransferState.TIMED_OUT
        elif now >= t.next_renew:
            self._send_quiet(t.peer, Message(MsgKind.RENEW, t.id, self.name))
            t.next_renew = now + self.lease_s / 3

    def _dispatch(self, msg: Message) -> None:
        if msg.kind is MsgKind.DRAINED:
            self._drained_in[msg.transfer_id] = DrainedNotice(msg.transfer_id, msg.sender,
                                                              time.monotonic())
            return
        if self._on_message(msg):
            return
        target = self._targets.get(msg.transfer_id)
        if target is not None:
            self._apply(target, msg)
            return
        mine = self._outgoing.get(msg.transfer_id)
        if mine is not None and msg.kind is MsgKind.ABORT and not mine.state.finished:
            self._cancel(mine)
            self._finish(mine, TransferState.ABORTED, f"aborted by peer {msg.sender}: {msg.detail}")
        elif mine is None:
            self._unclaimed.setdefault(msg.transfer_id, (time.monotonic(), []))[1].append(msg)

    def _apply(self, t: Transfer, msg: Message) -> None:
        if t.state.finished:
            return
        if msg.kind is MsgKind.DONE:
            t.state = TransferState.DONE
        elif msg.kind is MsgKind.RENEW:
            t.lease_until = time.monotonic() + t.lease_s
        elif msg.kind is MsgKind.ABORT:
            self._finish(t, TransferState.ABORTED, f"aborted by peer {msg.sender}: {msg.detail}")

    def _end_target(self, t: Transfer, state: TransferState, error: str) -> None:
        self._finish(t, state, error)
        # Tell the initiator, which may still be alive and writing, to stop.
        self._send_quiet(t.peer, Message(MsgKind.ABORT, t.id, self.name, error))

    def _start(self, role: Role, peer: str, local_blocks: Sequence[int],
               remote_blocks: Sequence[int], layers: range | None,
               transfer_id: str | None) -> Transfer:
        desc = self.peers.get(peer)
        if desc is None:
            raise TransferError(f"{self.name} is not connected to {peer!r}; call connect() first")
        layers = layers if layers is not None else range(self.layout.num_layers)
        plan = self._plan(role, desc, layers, local_blocks, remote_blocks)
        now = time.monotonic()
        # First RENEW 50 ms in, not at the first poll: a layer's write is done well before,
        # and a notification per write (32 per prompt) only loaded the path it renews.
        t = Transfer(transfer_id or uuid.uuid4().hex, peer, role, now + self.timeout_s,
                     self.lease_s, next_renew=now + min(self.lease_s / 3, 0.05))
        self._outgoing[t.id] = t
        self._open_out[t.id] = t
        early = [m for m in self._unclaimed.pop(t.id, (0, []))[1] if m.kind is MsgKind.ABORT]
        if early:  # the peer gave up already
            self._finish(t, TransferState.ABORTED, f"aborted by peer {peer}: {early[0].detail}")
            return t
        try:
            self._post(t, plan)
        except Exception as e:  # noqa: BLE001 - any backend error becomes a FAILED transfer
            self._finish(t, TransferState.FAILED, f"could not start with peer {peer}: {e!r}")
        return t

    def _finish(self, t: Transfer, state: TransferState, error: str) -> None:
        t.state, t.error = state, error
        log.info("%s: %s %s → %s: %s", self.name, t.role.value, t.id, state.value, error)

    def _send_quiet(self, peer: str, msg: Message) -> None:
        """Control messages are best effort: the peer may be gone, which is why we send them."""
        try:
            self._send(peer, msg)
        except Exception as e:  # noqa: BLE001
            self._undelivered(peer, msg, e)

    def _registered(self) -> torch.Tensor:
        if self.kv is None:
            raise TransferError(f"{self.name}: register() the KV cache first")
        return self.kv

    def _slice(self, offset: int, length: int) -> torch.Tensor:
        """Bytes [offset, offset + length) of the virtual concatenation of our shards, as a
        flat uint8 view of the one shard holding them (runs never span two)."""
        i = 0 if len(self._flat) == 1 else bisect.bisect_right(self._starts, offset) - 1
        rel = offset - self._starts[i]
        return self._flat[i][rel:rel + length]

    def _check_runs(self, runs) -> None:
        """Runs (offset, length) from a peer: each must lie within one of our shards."""
        if len(runs) and outside(np.asarray(self._starts, dtype=np.int64),
                                 np.asarray(runs, dtype=np.int64).reshape(-1, 2)):
            raise MessageError(f"runs outside the {self._starts[-1]}-byte KV cache's shards")

    # -- backend hooks (and Draining's _quiet, _serving; PeerTable's _disconnect) ---------
    @abstractmethod
    def _register(self) -> None:
        """Set up the backend for `self.shards` (registered memory, mailboxes, ...)."""

    @abstractmethod
    def _address(self) -> bytes:
        """Connection info a peer needs (NIXL agent metadata, UCX worker address, ...)."""

    @abstractmethod
    def _connect(self, peer: KVDescriptor) -> None: ...

    def _plan(self, role: Role, peer: KVDescriptor, layers: range, local_blocks: Sequence[int],
              remote_blocks: Sequence[int]) -> Any:
        """What `_post` gets (and where bad block ids raise): by default `_copies` as a list
        of (our offset, the peer's offset, length) tuples."""
        out = self._copies(role, peer, layers, local_blocks, remote_blocks)
        return list(zip(*(out[:, i].tolist() for i in range(3)))) if len(out) else []

    def _copies(self, role: Role, peer: KVDescriptor, layers: range,
                local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> np.ndarray:
        """[n, 3] int64 (our offset, the peer's offset, length): whole-block runs merged
        across blocks where the two sides' head windows match, else per-token head runs."""
        mine, theirs = self.shard_layouts, peer.layouts
        to_peer, from_peer = self._routes[peer.agent]
        if role is Role.WRITE:
            return shard_copies(mine, theirs, to_peer, layers, local_blocks, remote_blocks)
        out = shard_copies(theirs, mine, from_peer, layers, remote_blocks, local_blocks)
        return out[:, [1, 0, 2]]

    @abstractmethod
    def _post(self, t: Transfer, copies: list[Copy]) -> None:
        """Start `t`; copies are `_plan`'s: (our byte offset, the peer's byte offset, length)."""

    @abstractmethod
    def _check(self, t: Transfer) -> str | None:
        """None while running, "" when done, else the error text."""

    @abstractmethod
    def _cancel(self, t: Transfer) -> None: ...

    @abstractmethod
    def _send(self, peer: str, msg: Message) -> None: ...

    @abstractmethod
    def _recv(self) -> list[bytes]: ...

    def _on_message(self, msg: Message) -> bool:
        """Consume a backend-internal message (DATA, ACK, READ_REQ); True if it was one."""
        return False

    def _release(self, t: Transfer) -> None:
        """Free backend resources of a finished transfer."""

    def _close(self) -> None:
        """Free everything the backend holds."""
