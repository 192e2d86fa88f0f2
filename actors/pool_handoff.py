"""The pool handoff (mode `pooled`): prompt KV goes P → KV pool (a DistributedKVCache) → D.

PoolHandoff is the KVHandoff (actors/handoff.py) of pooled mode; PoolSender and PoolReceiver
are P's and D's parts, each with the engine's PoolClients (a PoolClient per pool):
    controller  on the first engine's join, the KV pools (kv_pool.placement: one for the
            cluster, or one on every node; kv_pool.capacity_*, else sized like an engine's KV
            cache; on the engines' transport), to each of which every engine actor connects
            as it opens its part. An engine's home pool is the one on its node (else the first).
    router  `release(attempt)` ends the attempt's hold (abort, a dead D, or D without room:
            D prefills it itself)
    P       first reads the prompt's prefix blocks that a pool holds and its own cache lacks
            (actors/pool_reuse.py), so it computes only the rest; after the prefill it puts
            the prompt's blocks into its home pool in one write, keyed by `prompt_keys` (full
            blocks by prefix hash, a partial last block by request) and held there for D
            under the request id; blocks the pool has already are not sent. A failed or
            refused put frees the pool's side and raises; a dead pool makes D prefill.
    D       reads the prompt blocks it lacks (past its own prefix hit) from that pool into its
            reserved blocks, then ends the hold, whether or not the read worked; a block
            missing from the pool fails the read (the router then has D prefill the prompt
            under the recompute policy).
Engines on a pool's node move blocks by a copy through its shared memory (actors/pool_shm.py);
the others through the transport (actors/pool_client.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from actors.handoff import Handover, KVEndpoint, KVHandoff, KVReceiver, KVSender, Prefill
from actors.kv_pool import node_id, start_pool
from actors.messages import KVDestination, PooledKV, PrefillResult
from actors.pool_client import PoolClient, PoolLost
from actors.pool_index import prompt_keys
from actors.pool_reuse import reuse_prefix
from pd_cluster.block_allocator import Block
from pd_cluster.engine import LLMEngine
from transfer.base import TransferError
from transfer.messages import KVDescriptor

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSettings:
    """What the handoff makes its pools with (router/app_config.py KVPoolConfig gives them)."""

    capacity_blocks: int | None = None     # None: capacity_bytes, else an engine's block count
    capacity_bytes: int | None = None
    placement: str = "single"              # "single" | "per_node"
    shared_memory: bool = True
    hold_s: float = 60.0

    @classmethod
    def of(cls, config: Any) -> PoolSettings:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def num_blocks(self, block_bytes: int, default: int) -> int:
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        if self.capacity_bytes is None:
            return default
        if self.capacity_bytes < block_bytes:
            raise ValueError(f"kv_pool.capacity_bytes: {self.capacity_bytes} is below one KV "
                             f"block ({block_bytes} bytes)")
        return self.capacity_bytes // block_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class PoolClients:
    """An engine's connections to the deployment's KV pools: a PoolClient per pool, by node."""

    clients: dict[str, PoolClient]
    home_node: str                       # the pool on the engine's node, else the first

    @property
    def home(self) -> PoolClient:
        return self.clients[self.home_node]

    def by_preference(self) -> list[PoolClient]:
        """The home pool's client first, then the others'."""
        return [self.home] + [c for n, c in self.clients.items() if n != self.home_node]


class PoolSender(KVSender):
    """P's part: reuse the pool's prefix blocks, prefill the rest, put the prompt's blocks."""

    def __init__(self, end: KVEndpoint, pools: PoolClients) -> None:
        super().__init__(end)
        self.pools = pools

    async def send(self, request_id: str, prompt_ids: list[int], destination: list | None,
                   prefill: Prefill, salt: str | None = None) -> Handover:
        end, pools = self.end, self.pools
        keys = prompt_keys(request_id, prompt_ids, end.layout.block_size, salt)
        reuse = asyncio.ensure_future(reuse_prefix(end, pools.by_preference(), prompt_ids,
                                                   keys, salt))
        try:
            kept = await asyncio.shield(reuse)
        except asyncio.CancelledError:   # the blocks it holds must still be let go of
            reuse.add_done_callback(lambda t: t.cancelled() or t.exception() is not None
                                    or _release_soon(end, t.result()))
            raise
        try:
            last = await prefill()
        except BaseException:
            _release_soon(end, kept)
            raise
        started = time.monotonic()
        # The request now holds the reused blocks itself: drop our references with the look.
        blocks = await end.loop.call(lambda e: _held_blocks(e, request_id, kept))
        try:
            added = await pools.home.put(keys, blocks, hold=request_id)
        except TransferError as e:
            if await pools.home.alive():
                raise
            # No pool to put into: never a failed request for that; D prefills it itself.
            log.warning("%s: the KV pool is gone (%s); the decode side prefills it",
                        request_id, e)
            return Handover(last, PooledKV(keys, stored=False), 0, started, started)
        return Handover(last, PooledKV(keys, pool=pools.home_node), end.bytes_of(added),
                        started, started)


class PoolReceiver(KVReceiver):
    """D's part: read the prompt blocks it lacks from the pool P put them in."""

    def __init__(self, end: KVEndpoint, pools: PoolClients) -> None:
        super().__init__(end)
        self.pools = pools

    async def prefetch(self, prompt_ids: list[int],
                       salt: str | None = None) -> Callable[[], None]:
        end = self.end
        keys = prompt_keys("", prompt_ids, end.layout.block_size, salt)   # full blocks read
        kept = await reuse_prefix(end, self.pools.by_preference(), prompt_ids, keys, salt)
        return lambda: _release_soon(end, kept)

    async def receive(self, request_id: str, reservation: KVDestination,
                      result: PrefillResult) -> None:
        end, keys = self.end, result.kv.keys
        client = self.pools.clients.get(result.kv.pool, self.pools.home)
        skip = reservation.num_cached_tokens // end.layout.block_size
        start = time.monotonic()
        try:
            got = await asyncio.wait_for(
                client.get(keys[skip:], reservation.block_ids[skip:]), end.timeout_s)
        except TransferError as e:
            if isinstance(e, PoolLost) or await client.alive():
                raise
            raise PoolLost(f"{request_id}: the KV pool died during the read ({e})") from e
        finally:
            client.release(request_id)
        if got < len(keys) - skip:
            raise TransferError(f"{request_id}: the KV pool holds {got} of the "
                                f"{len(keys) - skip} prompt blocks to read")
        end.count(end.bytes_of(got), time.monotonic() - start)


class PoolHandoff(KVHandoff):
    """See the module docstring. `config`: a KVPoolConfig (or PoolSettings); None: defaults."""

    sender_type: type[PoolSender] = PoolSender
    receiver_type: type[PoolReceiver] = PoolReceiver

    def __init__(self, timeout_s: float = 120.0, config: Any = None) -> None:
        self.timeout_s = timeout_s
        self.settings = PoolSettings() if config is None else PoolSettings.of(config)
        self.pools: dict[str, Any] = {}   # Ray node id → its DistributedKVCache actor

    @property
    def pool(self) -> Any:
        """The first pool (the only one with placement `single`)."""
        return next(iter(self.pools.values()))

    async def join(self, actor: Any, descriptor: bytes, peers: Sequence[tuple[Any, bytes]]
                   ) -> None:
        if not self.pools:
            # Made by the controller, so they live as long as it does; as many blocks as
            # configured, or as the first engine's KV cache (P and D run one engine config):
            # room for what a prefill engine holds at once, plus a prefix cache the size of one.
            kv = KVDescriptor.decode(descriptor)
            s = self.settings
            block_bytes = kv.layout.bytes_per_block_id
            layout = dataclasses.replace(
                kv.layout, num_blocks=s.num_blocks(block_bytes, kv.layout.num_blocks))
            nodes = _alive_nodes() if s.placement == "per_node" else [None]
            pools = [start_pool(layout, kv.backend, on_node=node, timeout_s=self.timeout_s,
                                hold_s=s.hold_s, shared_memory=s.shared_memory)
                     for node in nodes]
            where = await asyncio.gather(*[p.node.remote() for p in pools])
            self.pools = dict(zip(where, pools))
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
        for pool in self.pools.values():   # a no-op once D has read it, or where it is not
            pool.release.remote(attempt_id)

    async def pool_stats(self) -> dict[str, dict]:
        """Each live pool's stats (DistributedKVCache.stats), by node id."""
        async def one(pool: Any) -> dict | None:
            try:
                # Briefly: the router's load poll waits on this.
                return await asyncio.wait_for(pool.stats.remote(), 1.0)
            except Exception:  # noqa: BLE001 - a dead or busy pool is left out
                return None
        stats = await asyncio.gather(*[one(p) for p in self.pools.values()])
        return {node: st for node, st in zip(self.pools, stats) if st is not None}

    async def open_prefill(self, end: KVEndpoint, peers: list[bytes]) -> PoolSender:
        return self.sender_type(end, await self._connect(end))

    async def open_decode(self, end: KVEndpoint, peers: list[bytes]) -> PoolReceiver:
        return self.receiver_type(end, await self._connect(end))

    async def _connect(self, end: KVEndpoint) -> PoolClients:
        """An engine's clients of every pool, connected; its home pool the one on its node."""
        shards = end.loop.engine.kv_shards()
        # The same-node copy needs the whole KV cache in this process (one rank).
        kv = shards[0][0] if self.settings.shared_memory and len(shards) == 1 else None
        clients = {node: PoolClient(pool, end.pump, end.timeout_s, kv)
                   for node, pool in self.pools.items()}
        await asyncio.gather(*[c.connect() for c in clients.values()])
        here = node_id()
        return PoolClients(clients, here if here in clients else next(iter(clients)))


def _alive_nodes() -> list[str]:
    import ray
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


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

