"""HostTier: a node's host-memory tier of the KV cache hierarchy (docs/kv_tiers.md), the KV
pool (actors/kv_pool.py DistributedKVCache) with a disk tier under it.

Lifecycle:
    start_host_tier(layout, settings)  the first engine on a node with kv_tiers on starts it:
                     a detached actor named after the node (`pd-kv-tier-<node>`), so the
                     node's other engines, and a killed engine's replacement, find the same
                     one (and its blocks) by name; its memory is a shared-memory segment the
                     engines on the node copy to and from (actors/pool_shm.py)
    engines put      the prefix blocks they free (actors/kv_tiers.py): begin_put / end_local,
                     keyed by prefix hash, LRU like any pool
    host eviction    the evicted block's bytes go to the disk tier's writer queue
                     (actors/kv_tier_disk.py) unless that key is on disk already: written
                     once, and the pool never waits on the disk
    tier_lookup      how many of a prompt's keys are here, and how many with the disk's
    promote(keys)    reads the disk's blocks of the prompt's prefix (checksums checked; a bad
                     one ends the prefix there) into host blocks: the engine then gets them
                     from host memory like any other
    tier_changes     the prefix hashes stored in and dropped from host memory, for the engines
                     to mirror into their routers' reports
    renew()          every engine using it renews its lease (actors/engine_lease.py) each
                     second; with none for TIER_LEASE_S (the application deleted, its engines
                     gone and not replaced) the tier ends its own process: detached, nothing
                     else would free its host memory
    shutdown / death memory gone; the disk tier's files stay and a new HostTier on the node
                     indexes them again
The pool's lock is held for index changes and memory copies only, never for disk I/O.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from actors.engine_lease import EngineLease
from actors.kv_pool import DistributedKVCache, node_id
from actors.kv_tier_disk import DiskTier
from actors.pool_index import Key
from pd_cluster.block_allocator import MIN_EVENT_LOG, PrefixChanges, PrefixEventLog
from pd_cluster.kv_layout import KVLayout
from pd_cluster.kv_tiers import TierSettings

log = logging.getLogger(__name__)

TIER_NAME_PREFIX = "pd-kv-tier-"
# Longer than a killed engine's replacement takes to load its model and renew (what the
# tier is kept for), short enough that a deleted application's host memory comes back.
TIER_LEASE_S = 600.0


class HostTier(DistributedKVCache):
    """See the module docstring."""

    def __init__(self, layout: KVLayout, settings: TierSettings, timeout_s: float = 30.0,
                 lease_s: float | None = TIER_LEASE_S) -> None:
        """`lease_s`: None, no lease (in-process tests)."""
        # No peers: engines copy through the shared segment and confirm with end_local, so
        # the in-process transport only keeps the transfers' leases and deadlines.
        super().__init__(layout, "local", timeout_s=timeout_s, shared_memory=True)
        if self.segment is None:
            raise RuntimeError("the KV host tier needs a shared-memory segment (/dev/shm)")
        self.layout = layout
        self.index.events = PrefixEventLog(max(layout.num_blocks, MIN_EVENT_LOG))
        self.index.on_evict = self._to_disk
        self._flat = self.kv.flatten(0, 1)          # [layers x parts, blocks, ...]
        self._block_shape = self._flat[:, 0].shape
        self.block_bytes = layout.bytes_per_block_id
        self.disk: DiskTier | None = None
        if settings.disk_path is not None:
            # One directory per host: nodes may share a file system, never a block file.
            self.disk = DiskTier(os.path.join(settings.disk_path, socket.gethostname()),
                                 settings.disk_bytes, self.block_bytes)
        self.promote_s = 0.0          # seconds spent reading disk blocks back
        self.promoted = 0             # blocks read back from disk into host memory
        self.lease = None if lease_s is None else EngineLease(f"kv-tier-{self.node_id[:16]}",
                                                              lease_s)

    def renew(self) -> float:
        """An engine of the node still uses this tier: push its lease back."""
        return 0.0 if self.lease is None else self.lease.renew()

    def layout_of(self) -> KVLayout:
        return self.layout

    def tier_lookup(self, keys: Sequence[Key]) -> tuple[int, int]:
        """(keys from the first held in host memory, held in host memory or on disk)."""
        disk = self.disk if self.disk is not None else ()
        with self._lock:   # (the disk tier's own lock is never held while taking ours)
            cached = self.index.cached
            host = 0
            while host < len(keys) and keys[host] in cached:
                host += 1
            both = host
            while both < len(keys) and (keys[both] in cached or keys[both] in disk):
                both += 1
        return host, both

    def promote(self, keys: Sequence[Key]) -> tuple[int, int]:
        """Read the disk tier's blocks of the longest prefix of `keys` held in either tier
        into host memory; returns (how many keys, from the first, host memory holds now,
        how many blocks this call read from disk)."""
        if self.disk is None:
            return self.tier_lookup(keys)[0], 0
        began = time.monotonic()
        with self._lock:
            self.index.prefix(keys)        # the host ones most recent: not evicted below
            missing = [k for k in keys if k not in self.index.cached]
        payloads: list[tuple[Key, bytes]] = []
        for key in missing:                # disk reads outside the lock
            data = self.disk.read(key) if isinstance(key, int) else None
            if data is None:
                break
            payloads.append((key, data))
        with self._lock:
            blocks = self.index.allocate(len(payloads))
            for (key, data), block in zip(payloads, blocks):
                self._flat[:, block].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                                           .view(self.kv.dtype).view(self._block_shape))
            self.index.insert([k for k, _ in payloads[:len(blocks)]], blocks)
            self.promoted += len(blocks)
        self.promote_s += time.monotonic() - began
        return self.tier_lookup(keys)[0], len(blocks)

    def tier_changes(self, since: int) -> tuple[int, PrefixChanges]:
        """(epoch, the host index's prefix-hash changes after `since`), see PrefixEventLog."""
        events = self.index.events
        with self._lock:
            events.publish()
        return events.epoch, events.changes(since)

    def stats(self) -> dict:
        out = super().stats()
        out.update(tier="host", node=self.node_id, promoted=self.promoted,
                   promote_s=self.promote_s)
        if self.disk is not None:
            out.update(self.disk.stats, disk_used_bytes=self.disk.used_bytes(),
                       disk_capacity_bytes=self.disk.budget)
        return out

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the disk tier has written what it queued (tests)."""
        return True if self.disk is None else self.disk.flush(timeout_s)

    def shutdown(self) -> None:
        super().shutdown()
        if self.disk is not None:
            self.disk.close()

    def _to_disk(self, key: Key, block: int) -> None:
        """The index evicts `block` (lock held): its bytes to the disk tier, once per key."""
        if self.disk is None or not isinstance(key, int) or key in self.disk:
            return
        self.disk.write(key, self._flat[:, block].contiguous().view(torch.uint8)
                        .numpy().tobytes())


def tier_name(node: str) -> str:
    return TIER_NAME_PREFIX + node[:16]


def start_host_tier(layout: KVLayout, settings: TierSettings, timeout_s: float = 30.0) -> Any:
    """This node's HostTier actor: the running one, or a new one (see the module docstring);
    `layout` is an engine's, resized to the host tier's bytes."""
    import dataclasses

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = node_id()
    layout = dataclasses.replace(layout,
                                 num_blocks=settings.host_blocks(layout.bytes_per_block_id))
    return ray.remote(HostTier).options(
        name=tier_name(here), get_if_exists=True, lifetime="detached", num_cpus=0,
        max_concurrency=8,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    ).remote(layout, settings, timeout_s)
