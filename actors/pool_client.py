"""An engine's side of the KV pool (a DistributedKVCache, actors/kv_pool.py); the pool handoff
(actors/pool_handoff.py) uses one per pool.

PoolClient is an engine actor's side of the pool, async and touching the transport only on
the actor's pump thread (BlockingPoolClient is the same for a caller that may block):
    put(keys, blocks, hold) → begin_put → write our blocks into the granted ones → end_put
    get(keys, blocks)       → begin_get → read the granted blocks into ours     → end_get
The pool's confirmation (end_*) is asked for as soon as the grant is known, so its round trip
overlaps the transfer. A failed transfer, or a pool that died or did not answer within
timeout_s, raises TransferError, and the pool's side of the transfer is aborted.

On the pool's node (its shared segment mapped, actors/pool_shm.py) the engine copies the
blocks itself instead of moving them with the transport, and confirms with end_local:
    put → begin_put → copy our blocks into the granted ones → end_local
    get → begin_get → copy the granted blocks into ours     → end_local
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from actors.kv_pool import Grant, node_id
from actors.pool_index import Key
from actors.pool_shm import SharedSegment, copy_blocks
from actors.transport_pump import TransportPump
from transfer.base import KVTransport, TransferError


class PoolLost(TransferError):
    """The KV pool actor died: what it held is gone, whatever the request's failure policy
    (the router has D prefill the prompt itself)."""


class PoolClient:
    """`kv`: the engine's KV cache (its one shard), to copy through the pool's shared segment
    when the pool is on our node; None: always the transport."""

    def __init__(self, pool: Any, pump: TransportPump, timeout_s: float,
                 kv: torch.Tensor | None = None):
        self.pool, self.pump, self.timeout_s, self.kv = pool, pump, timeout_s, kv
        self.agent = self.pool_agent = ""  # our transport's name; the pool's
        self.dead = False   # the pool actor died: every call fails at once from then on
        self.segment: SharedSegment | None = None   # the pool's memory, mapped here

    async def connect(self) -> None:
        """Open channels both ways (two-sided transports acknowledge through them), and map
        the pool's shared segment if it is on our node."""
        desc = await self._call("descriptor", self.pool.descriptor.remote())
        self.pool_agent = await self._on_pump(lambda tr: tr.connect(desc))
        self.agent, mine = await self._on_pump(lambda tr: (tr.name, tr.descriptor().encode()))
        await self._call("connect", self.pool.connect.remote(mine))
        handle = await self._call("shared", self.pool.shared.remote())
        if handle is not None and self.kv is not None:
            self.segment = SharedSegment.attach(handle, node_id())

    async def put(self, keys: Sequence[Key], block_ids: Sequence[int],
                  hold: str | None = None) -> int:
        """Store our `block_ids` under `keys` (one per block), kept for one reader under
        `hold` if given; returns how many blocks were new to the pool."""
        grant = await self._call("begin_put", self.pool.begin_put.remote(self.agent, list(keys),
                                                                          hold))
        if self.segment is not None:
            return await self._copy(True, grant, block_ids)
        confirm = self.pool.end_put.remote(grant.transfer_id)
        await self._move(True, grant, block_ids)
        return await self._call("end_put", confirm)

    async def _copy(self, write: bool, grant: Grant, block_ids: Sequence[int]) -> int:
        """Move the granted blocks by a copy through the shared segment (off the event loop),
        then confirm; a failed copy fails the pool's side too."""
        ok = False
        try:
            if grant.block_ids:
                local = [block_ids[i] for i in grant.positions]
                pool_kv = self.segment.kv
                src, dst = (self.kv, pool_kv) if write else (pool_kv, self.kv)
                src_ids, dst_ids = (local, grant.block_ids) if write else (grant.block_ids, local)
                await asyncio.to_thread(copy_blocks, src, dst, src_ids, dst_ids)
            ok = True
        finally:
            confirmed = await self._call("end_local",
                                         self.pool.end_local.remote(grant.transfer_id, ok))
        return confirmed

    async def lookup(self, keys: Sequence[Key]) -> int:
        """How many of `keys`, from the first, the pool holds now."""
        return await self._call("lookup", self.pool.lookup.remote(list(keys)))

    async def get(self, keys: Sequence[Key], block_ids: Sequence[int]) -> int:
        """Fill our `block_ids` with the longest cached prefix of `keys`; returns its length."""
        grant = await self._call("begin_get", self.pool.begin_get.remote(self.agent, list(keys)))
        if self.segment is not None:
            return await self._copy(False, grant, block_ids)
        confirm = self.pool.end_get.remote(grant.transfer_id)
        await self._move(False, grant, block_ids)
        return await self._call("end_get", confirm)

    async def alive(self) -> bool:
        """Whether the pool actor answers (a failed transfer may have been its death)."""
        try:
            await self._call("lookup", self.pool.lookup.remote([]))
            return True
        except TransferError:
            return False

    def release(self, hold: str) -> Any:
        """End a hold in the pool (fire and forget; await the result to wait for it)."""
        return self.pool.release.remote(hold)

    async def _move(self, write: bool, grant: Grant, block_ids: Sequence[int]) -> None:
        if not grant.block_ids:
            return
        local = [block_ids[i] for i in grant.positions]

        def start(tr: KVTransport):
            op = tr.write if write else tr.read
            t = op(self.pool_agent, local, grant.block_ids, transfer_id=grant.transfer_id)
            return self.pump.wait_all([t], on_end=lambda: tr.release(t))
        try:
            done = await self._on_pump(start)
            await asyncio.wrap_future(done)   # the transfer's deadline bounds this
        except BaseException as e:
            # One that failed to start sent no ABORT, and a cancelled caller none either:
            # free the pool's blocks (and its waiting end_*) now. It may be gone: best effort.
            self.pool.abort.remote(grant.transfer_id, f"the client's transfer failed: {e!r}")
            raise

    async def _on_pump(self, fn) -> Any:
        return await asyncio.wrap_future(self.pump.call(fn))

    async def _call(self, method: str, ref: Any) -> Any:
        if self.dead:   # found dead before: fail at once, without a round trip
            raise PoolLost(f"the KV pool actor is dead ({method} not tried)")
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except RayActorError as e:
            self.dead = True
            raise PoolLost(f"the KV pool actor died during {method}: {e}") from e
        except RayTaskError as e:
            raise TransferError(f"the KV pool refused {method}: {e.cause!r}") from e
        except asyncio.TimeoutError as e:
            raise TransferError(f"the KV pool actor did not answer {method} within "
                                f"{self.timeout_s:g}s") from e


class BlockingPoolClient:
    """An engine's side of the KV pool, for a caller that owns its transport and may block
    (the engine actors use PoolClient, actors/pool_client.py): moves its own KV blocks in
    and out."""

    def __init__(self, pool, transport: KVTransport):
        self.pool, self.transport = pool, transport
        self.pool_name = transport.connect(self._call("descriptor"))
        self._call("connect", transport.descriptor().encode())

    def put(self, keys: Sequence[Key], block_ids: Sequence[int]) -> int:
        """Store our `block_ids` under `keys` (one per block); returns how many were new."""
        grant = self._call("begin_put", self.transport.name, list(keys))
        confirm = self.pool.end_put.remote(grant.transfer_id)
        self._move(self.transport.write, grant, block_ids)
        return self._call("end_put", ref=confirm)

    def get(self, keys: Sequence[Key], block_ids: Sequence[int]) -> int:
        """Fill our `block_ids` with the longest cached prefix of `keys`; returns its length."""
        grant = self._call("begin_get", self.transport.name, list(keys))
        confirm = self.pool.end_get.remote(grant.transfer_id)
        self._move(self.transport.read, grant, block_ids)
        return self._call("end_get", ref=confirm)

    def _move(self, start, grant: Grant, block_ids: Sequence[int]) -> None:
        """Move the granted blocks and wait. put/get ask for the pool's confirmation (end_*)
        before this: it waits for the DONE notice (or our ABORT), so its Ray round trip
        overlaps the transfer instead of following it."""
        if not grant.block_ids:
            return
        t = start(self.pool_name, [block_ids[i] for i in grant.positions], grant.block_ids,
                  transfer_id=grant.transfer_id)
        try:
            self.transport.wait(t)
        except TransferError as e:
            # One that failed to start sent no ABORT: free the pool's blocks (and its
            # waiting end_*) now, not at lease expiry. The pool may be gone: best effort.
            self.pool.abort.remote(grant.transfer_id, f"the client's transfer failed: {e}")
            raise
        finally:
            self.transport.release(t)

    def _call(self, method: str, *args, ref=None):
        try:
            if ref is None:
                ref = getattr(self.pool, method).remote(*args)
            return ray.get(ref, timeout=2 * self.transport.timeout_s)
        except ray.exceptions.RayActorError as e:
            raise TransferError(f"the KV pool actor died during {method}: {e}") from e
        except ray.exceptions.GetTimeoutError as e:
            raise TransferError(f"the KV pool actor did not answer {method} in time") from e
