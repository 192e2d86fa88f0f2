"""DistributedKVCache, the KV pool: a cluster-wide store of KV blocks in pinned host memory,
keyed by prefix block hash (Mooncake's idea): prefill engines put blocks in, decode engines
get them out, and prefill engines read the prefixes they can reuse (pooled mode,
actors/pool_handoff.py; an engine's side: actors/pool_client.py). One per cluster or one per
node; LRU eviction, never of a pinned block (held, or being read). `lookup(keys)` says how
many of a prompt's keys it holds, without pinning anything.

Lifecycle of a put (engine → pool):
    begin_put(peer, keys)  → Grant: pool blocks for the keys not cached yet, reserved under a lease
    the engine writes its blocks there with its transport, which renews the lease meanwhile
    DONE notice            → the blocks are indexed by key (most recently used, evictable)
    end_put(id)            → confirms (waits for the notice); an error if the put failed
Lifecycle of a get (pool → engine):
    begin_get(peer, keys)  → Grant: blocks of the longest cached prefix of keys, pinned under a lease
    the engine reads them  → DONE notice → unpinned;  end_get(id) confirms
A hold keeps a put's blocks for one reader (pooled mode: the decode engine of the request):
    begin_put(peer, keys, hold=id) pins the keys' blocks under the hold: cached ones at once,
                           the written ones when the put lands; so no eviction takes them
    release(id)            → unpins them, aborts the hold's put if still in flight, and drops
                             its RequestKeys (a prompt's partial last block, which no other
                             request can use); a hold not released within hold_s expires alike
With `shared_memory`, the blocks live in a shared-memory segment (actors/pool_shm.py) that
engines on the pool's node map: they copy to or from the granted blocks themselves and
confirm with end_local(id, ok) instead of the transport's DONE notice (the lease still
bounds a copier that died).
Abort, lease expiry, a deadline or a dead peer end a put by freeing its reserved blocks (and
its hold) and a get by unpinning, so nothing leaks. A progress thread polls the transport
every millisecond or so (notices, renewals, deadlines, hold expiry), and end_put/end_get poll
it themselves while they wait; every method holds the one lock.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.pool_index import BlockIndex, Key, RequestKey
from actors.pool_shm import SegmentHandle, SharedSegment
from pd_cluster.kv_layout import KVLayout
from transfer.base import Transfer, TransferError, TransferState
from transfer.registry import make_transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Grant:
    """The pool's side of one put or get: where to write (or read) and under which id."""

    transfer_id: str
    block_ids: list[int]   # pool blocks, one per key in `keys`
    keys: list[Key]        # put: the keys still to write (cached ones are skipped); get: the hits
    positions: list[int]   # index of each key in the caller's key list


@dataclass(slots=True)
class _Pending:
    kind: str              # "put" | "get"
    grant: Grant
    transfer: Transfer
    hold: str | None = None
    settled: bool = False


@dataclass(slots=True)
class _Hold:
    """Blocks kept for one reader: pinned once each, until release or `until`."""

    until: float                                        # monotonic expiry
    keys: list[Key]
    blocks: list[int] = field(default_factory=list)


class DistributedKVCache:
    """Start with `start_pool(...)`; see the module docstring for the protocol."""

    def __init__(self, layout: KVLayout, backend: str = "nixl", name: str | None = None,
                 timeout_s: float = 30.0, lease_s: float = 10.0, device: str = "cpu",
                 hold_s: float = 60.0, transport_options: dict | None = None,
                 shared_memory: bool = False):
        self.node_id = node_id()
        self.segment: SharedSegment | None = None
        if shared_memory and device == "cpu":   # engines on this node map it (actors/pool_shm.py)
            try:
                self.segment = SharedSegment.create(layout, self.node_id)
            except (OSError, RuntimeError) as e:   # /dev/shm too small: the transport, then
                log.warning("KV pool: no shared-memory segment of %d bytes (%s); engines on "
                            "this node go through the transport", layout.nbytes, e)
        if self.segment is not None:
            self.kv = self.segment.kv
        else:
            pin = device == "cpu" and torch.cuda.is_available()  # pinned memory DMAs at full speed
            self.kv = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device,
                                  pin_memory=pin)
        self.transport = make_transport(backend, name, timeout_s=timeout_s, lease_s=lease_s,
                                        **(transport_options or {}))
        self.transport.register(self.kv, layout)
        self.index = BlockIndex(layout.num_blocks)
        self._pending: dict[str, _Pending] = {}
        # Keys some put is writing now, and how many puts: another put without a hold skips
        # them (the KV tiers' engines of a node write the same prefix at once: P's and D's
        # copies would reserve it twice, and evict other keys to make the room).
        self._writing: dict[Key, int] = {}
        self._holds: dict[str, _Hold] = {}
        # Released holds, until hold_s later: a put that comes after its release (an abort
        # that overtook it) is refused instead of holding blocks nobody will read.
        self._released: dict[str, float] = {}
        self.hold_s = hold_s
        self.moved = {"put": 0, "get": 0}   # blocks written into the pool, read out of it
        self.copied = 0   # of those, blocks an engine on this node copied itself (end_local)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress_loop, daemon=True)
        self._thread.start()

    def descriptor(self) -> bytes:
        return self.transport.descriptor().encode()

    def node(self) -> str:
        """The Ray node this pool runs on."""
        return self.node_id

    def shared(self) -> SegmentHandle | None:
        """Where engines on this pool's node map its block memory (None: no segment)."""
        return None if self.segment is None else self.segment.handle

    def end_local(self, transfer_id: str, ok: bool) -> int:
        """Confirm a put or get whose blocks the engine copied itself, through the shared
        segment (`ok`: the copy worked); the same result as end_put / end_get. Nobody renews
        its lease meanwhile: a copier that died (or took longer than lease_s) expires it."""
        with self._lock:
            p = self._pending.get(transfer_id)
            if p is not None and not p.settled:
                self.copied += len(p.grant.block_ids) if ok else 0
                if ok:
                    p.transfer.state = TransferState.DONE
                else:
                    self.transport.abort(p.transfer, "the engine's copy failed")
                self._settle(p)
        return len(self._settle_wait(transfer_id).block_ids)

    def connect(self, peer_descriptor: bytes) -> str:
        with self._lock:
            return self.transport.connect(peer_descriptor)

    def begin_put(self, peer: str, keys: Sequence[Key], hold: str | None = None) -> Grant:
        """Reserve blocks for the keys not cached yet. With `hold`, every key's block is kept
        for one reader, and a pool too full to take them all refuses the put."""
        with self._lock:
            cached, writing = self.index.cached, (self._writing if hold is None else {})
            missing = [i for i, k in enumerate(keys) if k not in cached and k not in writing]
            if hold in self._released:
                raise TransferError(f"hold {hold} was released before its put")
            if hold is not None:  # pin the cached ones before allocating may evict them
                self._holds.setdefault(hold, _Hold(time.monotonic() + self.hold_s, []))
                present = [k for k in keys if k in cached]
                self._keep(hold, present, [cached[k] for k in present])
            blocks = self.index.allocate(len(missing))
            if hold is not None and len(blocks) < len(missing):
                self.index.free_ids.extend(blocks)
                self.release(hold)
                raise TransferError(f"the KV pool has no room for {len(missing)} more blocks "
                                    f"(hold {hold})")
            missing = missing[:len(blocks)]  # the pool may be full of pinned blocks
            grant = Grant(uuid.uuid4().hex, blocks, [keys[i] for i in missing], missing)
            for key in grant.keys:
                self._writing[key] = self._writing.get(key, 0) + 1
            self._track("put", peer, grant, hold)
            return grant

    def begin_get(self, peer: str, keys: Sequence[Key]) -> Grant:
        with self._lock:
            blocks = self.index.prefix(keys)
            self.index.pin(blocks, +1)
            grant = Grant(uuid.uuid4().hex, blocks, list(keys[:len(blocks)]),
                          list(range(len(blocks))))
            self._track("get", peer, grant)
            return grant

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many keys, from the first, the pool holds now (no pin: a get may find fewer)."""
        with self._lock:
            cached, n = self.index.cached, 0
            while n < len(keys) and keys[n] in cached:
                n += 1
            return n

    def end_put(self, transfer_id: str) -> int:
        """Wait for the put to settle; the number of blocks it added, or a TransferError."""
        return len(self._settle_wait(transfer_id).block_ids)

    def end_get(self, transfer_id: str) -> int:
        return len(self._settle_wait(transfer_id).block_ids)

    def abort(self, transfer_id: str, reason: str = "aborted by the pool's owner") -> None:
        with self._lock:
            p = self._pending.get(transfer_id)
            if p is not None:
                self.transport.abort(p.transfer, reason)
                self._settle(p)

    def release(self, hold: str) -> None:
        """End a hold: abort its put if still in flight, unpin its blocks, drop its
        RequestKeys. Releasing an unknown (or already ended) hold does nothing."""
        with self._lock:
            h = self._holds.pop(hold, None)
            self._released[hold] = time.monotonic() + self.hold_s
            for p in self._pending.values():
                if p.hold == hold and not p.settled:
                    self.transport.abort(p.transfer, f"hold {hold} released")
                    self._settle(p)
            if h is not None:
                self.index.pin(h.blocks, -1)
                self._drop_request_keys(h.keys)

    def stats(self) -> dict:
        with self._lock:
            ix = self.index
            reserved = sum(len(p.grant.block_ids) for p in self._pending.values()
                           if p.kind == "put" and not p.settled)
            block_bytes = self.transport.layout.bytes_per_block_id
            return dict(capacity=ix.num_blocks, free=len(ix.free_ids), cached=len(ix.cached),
                        reserved=reserved, pinned=len(ix.pins), holds=len(self._holds),
                        request_blocks=len(ix.orphans) + sum(
                            isinstance(k, RequestKey) for k in ix.cached),
                        hits=ix.hits, misses=ix.misses, evictions=ix.evictions,
                        in_flight=self.transport.in_flight(), block_bytes=block_bytes,
                        capacity_bytes=ix.num_blocks * block_bytes,
                        bytes_in=self.moved["put"] * block_bytes,
                        bytes_out=self.moved["get"] * block_bytes,
                        bytes_copied=self.copied * block_bytes)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self.transport.close()
            if self.segment is not None:
                self.segment.close()

    # -- internals -----------------------------------------------------------------------
    def _track(self, kind: str, peer: str, grant: Grant, hold: str | None = None) -> None:
        t = self.transport.expect(peer, grant.transfer_id)
        p = _Pending(kind, grant, t, hold)
        self._pending[grant.transfer_id] = p
        if not grant.block_ids:  # nothing to move: settled already
            t.state = TransferState.DONE
            self._settle(p)

    def _settle(self, p: _Pending) -> None:
        """Apply a finished transfer to the index exactly once, then free its transport state."""
        if p.settled:
            return
        p.settled = True
        ok = p.transfer.state is TransferState.DONE
        if ok:   # blocks moved in (put) or out (get), for the bytes in/out metrics
            self.moved[p.kind] += len(p.grant.block_ids)
        if p.kind == "put":
            for key in p.grant.keys:
                left = self._writing.pop(key, 1) - 1
                if left:
                    self._writing[key] = left
            if ok:
                kept = self.index.insert(p.grant.keys, p.grant.block_ids)
                if p.hold is not None:
                    self._keep(p.hold, p.grant.keys, kept)
            else:
                self.index.free_ids.extend(p.grant.block_ids)
                if p.hold is not None:
                    self.release(p.hold)
        else:
            self.index.pin(p.grant.block_ids, -1)
        self.transport.release(p.transfer)

    def _keep(self, hold: str, keys: Sequence[Key], block_ids: list[int]) -> None:
        """Pin the blocks of `keys` under a hold; if it ended meanwhile (released, expired),
        their RequestKeys have no reader left: drop them."""
        h = self._holds.get(hold)
        if h is None:
            self._drop_request_keys(keys)
            return
        h.keys.extend(keys)
        h.blocks.extend(block_ids)
        self.index.pin(block_ids, +1)

    def _drop_request_keys(self, keys: Sequence[Key]) -> None:
        for key in keys:
            if isinstance(key, RequestKey):
                self.index.drop(key)

    def _expire_holds(self) -> None:
        # Both dicts are in creation order, which (hold_s being fixed) is expiry order: look
        # only at their heads, since this runs every millisecond.
        now = time.monotonic()
        while self._holds and now > next(iter(self._holds.values())).until:
            self.release(next(iter(self._holds)))
        while self._released and now > next(iter(self._released.values())):
            del self._released[next(iter(self._released))]

    def _settle_wait(self, transfer_id: str) -> Grant:
        """Drive the transport ourselves until the transfer settles.

        The caller confirms right after its own transfer completed, so the DONE notice is
        (nearly) here: polling now, spinning briefly and then backing off from 50 µs to
        0.5 ms, settles it at once, where sleeping 1 ms between looks at what the progress
        thread (itself on a 1 ms tick) had done added up to 2 ms to every put and get.
        """
        spin_until, pause = time.monotonic() + 2e-3, 5e-5
        while True:
            with self._lock:
                p = self._pending.get(transfer_id)
                if p is None:
                    raise TransferError(f"unknown or already ended transfer {transfer_id}")
                if not p.settled:
                    self._pump()
                if p.settled:
                    del self._pending[transfer_id]
                    p.transfer.raise_if_failed()
                    return p.grant
            if time.monotonic() > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)
            else:
                time.sleep(0)  # let the other threads (Ray's, the progress one) have the GIL

    def _pump(self) -> None:
        """One progress step of the transport, then apply whatever finished (lock held)."""
        self.transport.progress()
        for p in self._pending.values():
            if p.transfer.state.finished:
                self._settle(p)

    def _progress_loop(self) -> None:
        # Notices nobody waits on yet, lease renewals and deadlines; end_put/end_get pump
        # themselves, so a 1 ms tick is on nobody's critical path.
        while not self._stop.wait(1e-3):
            with self._lock:
                self._pump()
                self._expire_holds()
                self._forget_unclaimed_settled()

    def _forget_unclaimed_settled(self) -> None:
        """Failed transfers nobody asked about (the peer died) must not pile up."""
        stale = [tid for tid, p in self._pending.items()
                 if p.settled and time.monotonic() > p.transfer.deadline]
        for tid in stale:
            del self._pending[tid]


def node_id() -> str:
    """The Ray node this runs on ("local" outside Ray: tests in one process)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return "local"


def start_pool(layout: KVLayout, backend: str = "nixl", num_cpus: float = 0,
               on_node: str | None = None, **kwargs) -> Any:
    """Start the KV pool, a DistributedKVCache actor (methods may wait, so a few run
    concurrently), on the Ray node `on_node` if given (one pool per node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = dict(num_cpus=num_cpus, max_concurrency=8)
    if on_node is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(on_node, soft=False)
    return ray.remote(DistributedKVCache).options(**options).remote(layout, backend, **kwargs)
