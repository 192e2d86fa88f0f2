"""An engine actor's side of the KV cache hierarchy (docs/kv_tiers.md): its node's host tier
(actors/kv_tier_host.py HostTier, with the disk tier under it), in every mode.

Lifecycle (TierClient, one per engine actor, on its event loop):
    start()       finds or starts the node's HostTier, maps its shared segment (the engine's
                  KV cache must be one shard in this process, and the layouts must match;
                  else the tiers stay off for this engine, with a warning) and has the
                  engine's allocator list the blocks it caches under a hash; then OFF → ON
                  and a background task runs:
    offload       every OFFLOAD_EVERY_S, the listed blocks not yet written down: a
                  reference each (engine thread; only blocks still holding their hash, whose
                  content is final; of free ones at most half the free blocks at once), a copy into the host tier's granted blocks (off the event loop),
                  the references dropped. A hash is written
                  once: the blocks this engine put are remembered (OFFLOADED_MEMORY of them)
                  and the host tier skips keys it holds
    mirror        every MIRROR_EVERY_S, the host tier's stored / dropped prefix hashes into
                  the engine's PrefixEventLog (offloaded / unloaded events), which routers
                  read with its prefix reports; the engine's measured prefill rate into the
                  cost rule; the host tier's lease renewed and its stats fetched (the
                  engine's load report carries them to the routers' metrics: `report`)
    reuse(ids)    before a prompt is computed (colocated: generate; P: prefill; D: reserve):
                  the longest prefix held locally, in host memory and on disk; LoadCost
                  decides how far to load (none, host part, host and disk parts); disk blocks
                  are promoted into host memory first (the HostTier reads them, checksums
                  checked), then copied into fresh engine blocks, indexed as cached. The
                  caller releases the returned references once the request holds its blocks
    tier death    ON → OFF (no loads; freed blocks not listed for it) → a new HostTier found
                  or started on the node (its memory empty, its disk files indexed again) →
                  ON; until one can be, OFF, retried every MIRROR_EVERY_S
    close()       ON → CLOSED: the task stops; the HostTier lives on (detached, per node), so
                  a replacement engine on the node finds what this one put
Any failure of the tier (dead, slow, refused) only costs the reuse or the offload: logged,
counted, never a failed request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError

from actors.kv_pool import node_id
from actors.kv_tier_host import start_host_tier
from actors.pool_shm import SharedSegment, copy_blocks
from pd_cluster.block_allocator import Block, prefix_block_hashes
from pd_cluster.kv_tiers import LoadCost, Tier, TierSettings

if TYPE_CHECKING:
    from actors.engine_loop import EngineLoop
    from pd_cluster.engine import LLMEngine

log = logging.getLogger(__name__)

OFFLOAD_EVERY_S = 0.02
MIRROR_EVERY_S = 1.0
# Hashes this engine remembers having written down (beyond, a repeat costs one round trip:
# the host tier skips keys it holds).
OFFLOADED_MEMORY = 1 << 16


class TierState(str, enum.Enum):
    OFF = "off"          # not started, or refused (no shared memory, several shards, ...)
    ON = "on"
    CLOSED = "closed"


class TierClient:
    """See the module docstring. `settings`: a KVTiersConfig or TierSettings."""

    def __init__(self, loop: EngineLoop, settings: Any, timeout_s: float = 30.0) -> None:
        self.loop, self.timeout_s = loop, timeout_s
        self.settings = settings if isinstance(settings, TierSettings) \
            else TierSettings.of(settings)
        self.cost = LoadCost(self.settings)
        self.state = TierState.OFF
        self.pool: Any = None
        self.segment: SharedSegment | None = None
        self._offloaded: OrderedDict[int, None] = OrderedDict()
        self._host: set[int] = set()       # the host tier's hashes as last mirrored
        self._cursor = -1
        self._epoch: int | None = None
        self._task: asyncio.Task | None = None
        self._prefill_seen = (0, 0.0)
        self._offloading = asyncio.Lock()   # one offload at a time: a flush waits for it
        self.stats = {"host_hits": 0, "disk_hits": 0, "loads": 0, "load_s": 0.0,
                      "recomputed": 0, "offloaded": 0, "errors": 0}
        self.host_stats: dict = {}         # the node's host tier's, as last fetched
        self._read_copy_s = 0.0            # how long the last read's copy took

    async def start(self) -> None:
        shards = self.loop.engine.kv_shards()
        if len(shards) != 1:
            log.warning("KV tiers off for this engine: its KV cache is %d shards (tensor "
                        "parallel); the host tier copy needs one", len(shards))
            return
        self.kv, self.layout = shards[0]
        self.block_size = self.layout.block_size
        self.block_bytes = self.layout.bytes_per_block_id
        if not await self._attach():
            return
        await self.loop.call(lambda e: e.kv.allocator.collect_offloads())
        self.state = TierState.ON
        self._task = asyncio.ensure_future(self._run())

    async def _attach(self) -> bool:
        """Find or start the node's host tier and map its memory; False: not usable (why is
        logged). Also how a tier that died is replaced (a new one, its memory empty, its
        disk files found again)."""
        layout = self.layout
        try:
            pool = start_host_tier(layout, self.settings, self.timeout_s)
            handle = await self._ask(pool.shared.remote())
        except Exception as e:  # noqa: BLE001 - no tier: the engine serves without
            log.warning("KV tiers off for this engine: no host tier on its node (%s)", e)
            return False
        theirs = handle.layout if handle is not None else None
        if theirs is None or _resized(theirs, layout.num_blocks) != layout:
            log.warning("KV tiers off for this engine: the node's host tier has another KV "
                        "layout (%s, ours %s)", theirs, layout)
            return False
        segment = SharedSegment.attach(handle, node_id())
        if segment is None:
            log.warning("KV tiers off for this engine: cannot map the host tier's memory")
            return False
        if self.segment is not None:
            self.segment.close()
        self.pool, self.segment = pool, segment
        self._cursor, self._epoch = -1, None      # a new tier's events start over
        return True

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.state = TierState.CLOSED

    # -- reuse ------------------------------------------------------------------------------
    async def reuse(self, prompt_ids: list[int], salt: str | None = None) -> list[Block]:
        """Hold the prompt's cached prefix, loading what the tiers hold past it when that
        beats computing it (module docstring). Returns the blocks it holds a reference on,
        for the caller to release (`KVCacheManager.release_blocks`, engine thread)."""
        if self.state is not TierState.ON:
            return []
        local = await self.loop.call(lambda e: e.kv.hold_cached_prefix(prompt_ids, salt))
        first = len(local)
        limit = (len(prompt_ids) - 1) // self.block_size      # never the last token's block
        if limit <= first:
            return local
        keys = prefix_block_hashes(prompt_ids[:limit * self.block_size], self.block_size,
                                   salt)
        try:
            host, both = await self._ask(self.pool.tier_lookup.remote(keys))
            in_host = max(host, first)      # keys past this one are on disk
            target = self._worth(first, host, both)
            if target <= first:
                self.stats["recomputed"] += max(both - first, 0)
                return local
            began = time.monotonic()
            promoted, promote_s = 0, 0.0
            if target > max(host, first):
                host, promoted = await self._ask(self.pool.promote.remote(keys[:target]))
                promote_s = time.monotonic() - began
                target = min(target, host)
            read = (await self._read(prompt_ids, keys, first, target, salt) if target > first
                    else [])
        except Exception as e:  # noqa: BLE001 - a tier that fails costs the reuse only
            self.stats["errors"] += 1
            log.warning("KV tiers: loading a prefix failed (%s); computing it", e)
            return local
        seconds = time.monotonic() - began
        # Blocks past the host part came from disk: this call's promotion read them, or a
        # concurrent one (another engine of the node asked for the same prompt).
        from_disk = min(promoted, max(0, first + len(read) - in_host))
        self.stats["host_hits"] += len(read) - from_disk
        self.stats["disk_hits"] += from_disk
        self.stats["loads"] += 1 if read else 0
        self.stats["load_s"] += seconds
        if read:   # each copy's bandwidth, and what the load took beyond the copies
            copy_s = self._read_copy_s
            self.cost.loaded(Tier.HOST, len(read) * self.block_bytes, copy_s)
            if promoted:
                self.cost.loaded(Tier.DISK, promoted * self.block_bytes, promote_s)
            self.cost.overhead(seconds - copy_s - promote_s)
        return local + read

    def _worth(self, first: int, host: int, both: int) -> int:
        """How many keys to have loaded (from the first): `first` (recompute), `host` or
        `both`, whichever saves the most time."""
        best, best_saving = first, 0.0
        options = [host] if host > first else []
        if both > max(host, first):
            options.append(both)
        for end in options:
            in_host = max(0, min(host, end) - first)
            on_disk = end - first - in_host
            saving = self.cost.saving((end - first) * self.block_size,
                                      {Tier.HOST: (in_host + on_disk) * self.block_bytes,
                                       Tier.DISK: on_disk * self.block_bytes})
            if saving > best_saving:
                best, best_saving = end, saving
        return best

    async def _read(self, prompt_ids: list[int], keys: list[int], first: int, end: int,
                    salt: str | None) -> list[Block]:
        """Copy the host tier's blocks of keys[first:end] into fresh engine blocks, indexed
        as cached (under the prompt's cache salt); the ones read (a reference each)."""
        fresh = await self.loop.call(lambda e: e.kv.blocks_for_import(end - first))
        got = 0
        try:
            if fresh:
                got = await self._copy(False, keys[first:first + len(fresh)],
                                       [b.block_id for b in fresh])
        finally:
            read, unused = fresh[:got], fresh[got:]

            def adopt(engine: LLMEngine) -> None:
                engine.kv.cache_imported(prompt_ids, first, read, salt)
                engine.kv.release_blocks(unused)
            if fresh:
                await self.loop.call(adopt)
        for key in keys[first:first + len(read)]:   # the tier has them: no put when freed
            self._offloaded[key] = None
        return read

    # -- offload ----------------------------------------------------------------------------
    async def _run(self) -> None:
        last_mirror = 0.0
        while True:
            await asyncio.sleep(OFFLOAD_EVERY_S)
            try:
                if self.loop.engine.kv.allocator.offloads:   # a length read: no lock needed
                    await self._offload()
                if time.monotonic() - last_mirror > MIRROR_EVERY_S:
                    last_mirror = time.monotonic()
                    await self._mirror()
                    self._measure_prefill()
                    self.pool.renew.remote()       # (its answer is not needed)
                    self.host_stats = await self._ask(self.pool.stats.remote())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next round tries again
                self.stats["errors"] += 1
                log.warning("KV tiers: offload or mirror failed: %s", e)
                if isinstance(e, RayActorError):   # the tier died: find or start another
                    await self._replace_tier()
                await asyncio.sleep(MIRROR_EVERY_S)

    async def _replace_tier(self) -> None:
        self.state = TierState.OFF    # no loads meanwhile
        # What was freed meanwhile has no tier to go to (the list would only grow).
        await self.loop.call(lambda e: e.kv.allocator.offloads.clear())
        self._offloaded.clear()       # the old tier's blocks are gone with it
        if await self._attach():
            self.state = TierState.ON

    async def _offload(self) -> None:
        async with self._offloading:
            await self._offload_freed()

    async def _offload_freed(self) -> None:
        done = self._offloaded

        def take(engine: LLMEngine) -> list[Block]:
            allocator = engine.kv.allocator
            todo, allocator.offloads = allocator.offloads, []
            # Blocks in use are copied as they are (full and hashed: their content is final;
            # the copy's stream waits for the step that wrote them). Of free ones, at most
            # half the free blocks at once (the rest wait for the next round): a copy in
            # flight holds its blocks, and a reservation or step meanwhile must find room.
            room = allocator.num_free // 2
            picked: dict[int, Block] = {}
            for i, b in enumerate(todo):  # still hashed, not written down yet
                if b.block_hash is None or b.block_hash in done:
                    continue
                if b.ref_count == 0:
                    if room == 0:
                        allocator.offloads[:0] = todo[i:]
                        break
                    room -= 1
                picked[b.block_id] = b
            blocks = list(picked.values())
            allocator.touch(blocks)     # out of the free queue until copied
            return blocks
        blocks = await self.loop.call(take)
        if not blocks:
            return
        try:
            keys = [b.block_hash for b in blocks]
            await self._copy(True, keys, [b.block_id for b in blocks])
            for key in keys:
                done[key] = None
            while len(done) > OFFLOADED_MEMORY:
                done.popitem(last=False)
            self.stats["offloaded"] += len(keys)
        finally:
            def let_go(engine: LLMEngine) -> None:
                engine.kv.allocator.release(blocks)
                # Our own release listed them again: they are written (or failed) already.
                offloads = engine.kv.allocator.offloads
                if offloads:
                    ids = {b.block_id for b in blocks}
                    offloads[:] = [b for b in offloads if b.block_id not in ids]
            await self.loop.call(let_go)

    async def _copy(self, write: bool, keys: list[int], block_ids: list[int]) -> int:
        """Put (write) our `block_ids` under `keys` into the host tier, or get (read) the
        longest held prefix of `keys` into them, by a copy through its shared memory."""
        begin = self.pool.begin_put if write else self.pool.begin_get
        grant = await self._ask(begin.remote("", keys))
        ok = False
        try:
            if grant.block_ids:
                local = [block_ids[i] for i in grant.positions]
                src, dst = (self.kv, self.segment.kv) if write else (self.segment.kv, self.kv)
                src_ids, dst_ids = (local, grant.block_ids) if write else (grant.block_ids, local)
                copying = time.monotonic()
                await asyncio.to_thread(copy_blocks, src, dst, src_ids, dst_ids,
                                        self.segment.pinned)
                if not write:   # the cost rule's host bandwidth (the last read's)
                    self._read_copy_s = time.monotonic() - copying
            ok = True
        finally:
            done = await self._ask(self.pool.end_local.remote(grant.transfer_id, ok))
        return done

    # -- routing's view, the cost rule's rate -------------------------------------------------
    async def _mirror(self) -> None:
        """The host tier's hash changes into the engine's prefix events (offloaded/unloaded)."""
        epoch, ch = await self._ask(self.pool.tier_changes.remote(self._cursor))
        if epoch != self._epoch or ch.since < 0:
            now = set(ch.stored)
            added, gone = now - self._host, self._host - now
        else:
            added, gone = set(ch.stored), set(ch.removed)
        self._epoch, self._cursor = epoch, ch.cursor
        if not added and not gone:
            return
        self._host = (self._host | added) - gone

        def record(engine: LLMEngine) -> None:
            events = engine.kv.allocator.events
            if events is not None:
                for h in added:
                    events.offloaded(h)
                for h in gone:
                    events.unloaded(h)
        await self.loop.call(record)

    def _measure_prefill(self) -> None:
        totals = self.loop.engine.step_totals
        tokens = sum(totals[k].work.sum_tokens for k in ("prefill", "mixed"))
        seconds = sum(totals[k].seconds for k in ("prefill", "mixed"))
        last_tokens, last_s = self._prefill_seen
        self._prefill_seen = (tokens, seconds)
        self.cost.prefilled(tokens - last_tokens, seconds - last_s)

    async def _ask(self, ref: Any) -> Any:
        return await asyncio.wait_for(ref, self.timeout_s)


def _resized(layout: Any, num_blocks: int) -> Any:
    return dataclasses.replace(layout, num_blocks=num_blocks)

