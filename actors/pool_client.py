"""An engine actor's side of the DistributedKVCache, driven through the actor's TransportPump.

The protocol is KVCacheClient's (actors/kv_pool.py), but async and touching the transport
only on its pump thread, which owns it in the engine actors:
    put(keys, blocks, hold) → begin_put → write our blocks into the granted ones → end_put
    get(keys, blocks)       → begin_get → read the granted blocks into ours     → end_get
The pool's confirmation (end_*) is asked for as soon as the grant is known, so its round trip
overlaps the transfer. A failed transfer, or a pool that died or did not answer within
timeout_s, raises TransferError, and the pool's side of the transfer is aborted.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from actors.kv_pool import Grant
from actors.pool_index import Key
from actors.transport_pump import TransportPump
from transfer.base import KVTransport, TransferError


class PumpKVCacheClient:
    def __init__(self, pool: Any, pump: TransportPump, timeout_s: float):
        self.pool, self.pump, self.timeout_s = pool, pump, timeout_s
        self.agent = self.pool_agent = ""  # our transport's name; the pool's

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

    async def get(self, keys: Sequence[Key], block_ids: Sequence[int]) -> int:
        """Fill our `block_ids` with the longest cached prefix of `keys`; returns its length."""
        grant = await self._call("begin_get", self.pool.begin_get.remote(self.agent, list(keys)))
        confirm = self.pool.end_get.remote(grant.transfer_id)
        await self._move(False, grant, block_ids)
        return await self._call("end_get", confirm)

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
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except RayActorError as e:
            raise TransferError(f"the KV cache actor died during {method}: {e}") from e
        except RayTaskError as e:
            raise TransferError(f"the KV cache refused {method}: {e.cause!r}") from e
        except asyncio.TimeoutError as e:
            raise TransferError(f"the KV cache actor did not answer {method} within "
                                f"{self.timeout_s:g}s") from e
