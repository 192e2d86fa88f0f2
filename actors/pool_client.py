"""The pool handoff (mode `pooled`): prompt KV goes P → KV pool (a DistributedKVCache) → D.

PoolHandoff is the KVHandoff (actors/handoff.py) of pooled mode:
    controller  on the first engine's join, one KV pool (sized like an engine's KV cache,
            on the same transport) to which every engine actor connects as it joins
    router  `release(attempt)` ends the attempt's hold there (abort, a dead D, or D without
            room: D prefills it itself)
    P       after the prefill, puts the prompt's blocks into the pool in one write, keyed by
            `prompt_keys` (full blocks by prefix hash, a partial last block by request) and
            held there for D under the request id; blocks the pool has already are not sent.
            A failed or refused put frees the pool's side and raises.
    D       reads the prompt blocks it lacks (past its own prefix hit) into its reserved
            blocks, then ends the hold, whether or not the read worked; a block missing from
            the pool fails the request like a failed transfer.

PoolClient is an engine actor's side of the pool, async and touching the transport only on
the actor's pump thread (BlockingPoolClient is the same for a caller that may block):
    put(keys, blocks, hold) → begin_put → write our blocks into the granted ones → end_put
    get(keys, blocks)       → begin_get → read the granted blocks into ours     → end_get
The pool's confirmation (end_*) is asked for as soon as the grant is known, so its round trip
overlaps the transfer. A failed transfer, or a pool that died or did not answer within
timeout_s, raises TransferError, and the pool's side of the transfer is aborted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.handoff import Handover, KVEndpoint, KVHandoff, Prefill
from actors.kv_pool import Grant, start_pool
from actors.messages import KVDestination, PooledKV, PrefillResult
from actors.pool_index import Key, prompt_keys
from actors.pool_reuse import reuse_prefix
from actors.transport_pump import TransportPump
from pd_cluster.block_allocator import Block
from pd_cluster.engine import LLMEngine
from transfer.base import KVTransport, TransferError
from transfer.messages import KVDescriptor

log = logging.getLogger(__name__)


class PoolClient:
    def __init__(self, pool: Any, pump: TransportPump, timeout_s: float):
        self.pool, self.pump, self.timeout_s = pool, pump, timeout_s
        self.agent = self.pool_agent = ""  # our transport's name; the pool's
        self.dead = False   # the pool actor died: every call fails at once from then on

    async def connect(self) -> None:
        """Open channels both ways (two-sided transports acknowledge through them)."""
        desc = await self._call("descriptor", self.pool.descriptor.remote())
        self.pool_agent = await self._on_pump(lambda tr: tr.connect(desc))
        self.agent, mine = await self._on_pump(lambda tr: (tr.name, tr.descriptor().encode()))
        await self._call("connect", self.pool.connect.remote(mine))

    async def put(self, keys: Sequence[Key], block_ids: Sequence[int],
                  hold: str | None = None) -> int:
        """Store our `block_ids` under `keys` (one per block), kept for one reader under
        `hold` if given; returns how many blocks were new to the pool."""
        grant = await self._call("begin_put", self.pool.begin_put.remote(self.agent, list(keys),
                                                                          hold))
        confirm = self.pool.end_put.remote(grant.transfer_id)
        await self._move(True, grant, block_ids)
        return await self._call("end_put", confirm)

    async def lookup(self, keys: Sequence[Key]) -> int:
        """How many of `keys`, from the first, the pool holds now."""
        return await self._call("lookup", self.pool.lookup.remote(list(keys)))

    async def get(self, keys: Sequence[Key], block_ids: Sequence[int]) -> int:
        """Fill our `block_ids` with the longest cached prefix of `keys`; returns its length."""
        grant = await self._call("begin_get", self.pool.begin_get.remote(self.agent, list(keys)))
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
            raise TransferError(f"the KV pool actor is dead ({method} not tried)")
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except RayActorError as e:
            self.dead = True
            raise TransferError(f"the KV pool actor died during {method}: {e}") from e
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


class PoolHandoff(KVHandoff):
    """See the module docstring."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.pool: Any = None       # the DistributedKVCache actor, once connected

    async def join(self, actor: Any, descriptor: bytes, peers: Sequence[tuple[Any, bytes]]
                   ) -> None:
        if self.pool is None:
            # As many blocks as the first engine's KV cache (P and D run one engine config),
            # on its transport: room for what a prefill engine holds at once, plus a prefix
            # cache the size of one. Made by the controller, so it lives as long as it does.
            kv = KVDescriptor.decode(descriptor)
            self.pool = start_pool(kv.layout, kv.backend, timeout_s=self.timeout_s)
        await actor.open_handoff.remote(self, [])

    def destination(self, reservation: Any) -> None:
        return None

    async def accept(self, attempt_id: str, result: PrefillResult,
                     reservation: Any) -> PrefillResult | None:
        # D had no room, or the pool died with the prompt's blocks: D prefills it itself.
        if await reservation is None or not result.kv.stored:
            self.release(attempt_id)
            return None
        return result

    def release(self, attempt_id: str) -> None:
        self.pool.release.remote(attempt_id)   # a no-op once D has read it

    async def open_prefill(self, end: KVEndpoint, peers: list[bytes]) -> None:
        await self._open(end)

    async def open_decode(self, end: KVEndpoint, peers: list[bytes]) -> None:
        await self._open(end)

    async def _open(self, end: KVEndpoint) -> None:
        self.end, self.client = end, PoolClient(self.pool, end.pump, end.timeout_s)
        await self.client.connect()

    async def send(self, request_id: str, prompt_ids: list[int], destination: list | None,
                   prefill: Prefill) -> Handover:
        end = self.end
        keys = prompt_keys(request_id, prompt_ids, end.layout.block_size)
        kept = await reuse_prefix(end, self.client, prompt_ids, keys)
        try:
            last = await prefill()
        except BaseException:
            _release_soon(end, kept)
            raise
        started = time.monotonic()
        # The request now holds the reused blocks itself: drop our references with the look.
        blocks = await end.loop.call(lambda e: _held_blocks(e, request_id, kept))
        try:
            added = await self.client.put(keys, blocks, hold=request_id)
        except TransferError as e:
            if await self.client.alive():
                raise
            # No pool to put into: never a failed request for that; D prefills it itself.
            log.warning("%s: the KV pool is gone (%s); the decode side prefills it", request_id, e)
            return Handover(last, PooledKV(keys, stored=False), 0, started, started)
        return Handover(last, PooledKV(keys), end.bytes_of(added), started, started)

    async def receive(self, request_id: str, reservation: KVDestination,
                      result: PrefillResult) -> None:
        end, keys = self.end, result.kv.keys
        skip = reservation.num_cached_tokens // end.layout.block_size
        start = time.monotonic()
        try:
            got = await asyncio.wait_for(
                self.client.get(keys[skip:], reservation.block_ids[skip:]), end.timeout_s)
        finally:
            self.client.release(request_id)
        if got < len(keys) - skip:
            raise TransferError(f"{request_id}: the KV pool holds {got} of the "
                                f"{len(keys) - skip} prompt blocks to read")
        end.count(end.bytes_of(got), time.monotonic() - start)


def _held_blocks(engine: LLMEngine, request_id: str, kept: list[Block]) -> list[int]:
    engine.kv.release_blocks(kept)
    req = engine.scheduler.holding.get(request_id)
    if req is None:
        raise RuntimeError(f"prefill of {request_id} was aborted")
    return list(req.block_ids)


def _release_soon(end: KVEndpoint, blocks: list[Block]) -> None:
    """Drop the references `reuse_prefix` took (a failed or aborted prefill), not waited on."""
    if blocks:
        asyncio.ensure_future(end.loop.call(lambda e: e.kv.release_blocks(blocks)))
