"""Prefix reuse from the KV pool: before a prefill engine computes a prompt, it reads the
prompt's prefix blocks that the pool holds (and its own prefix cache lacks) into its own KV
cache, instead of computing them.

    1. at once: the engine thread holds the prompt's full blocks cached locally (a reference
       each); each pool says how many of the prompt's keys it holds (`lookup`)
    2. the pool with the longest run wins, if it goes past the local hit
    3. engine thread: fresh blocks for the rest of its run (none if the cache has no room)
    4. pool → engine: read them (`PoolClient.get`; the pool may have evicted some since 1)
    5. engine thread: index the blocks read under their prefix hashes; free the others
The request is then added as usual: the scheduler finds the whole run as a prefix-cache hit,
so chunked prefill starts after it and the hit counts in num_cached_tokens (the API's
cached_tokens, the pd_prefix_cache_hits metric). The caller keeps the references until the
request holds the blocks itself (its prefill is done), so no eviction takes them before the
scheduler gets to the request. A pool that fails or died only costs the reuse: the prompt
is computed in full.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from actors.pool_index import Key
from pd_cluster.block_allocator import Block
from transfer.base import TransferError

if TYPE_CHECKING:
    from actors.handoff import KVEndpoint
    from actors.pool_client import PoolClient

log = logging.getLogger(__name__)


async def reuse_prefix(end: KVEndpoint, clients: Sequence[PoolClient], prompt_ids: list[int],
                       keys: Sequence[Key], salt: str | None = None) -> list[Block]:
    """Make a pool's blocks of the prompt's prefix a prefix-cache hit of `end`'s engine (see
    the module docstring): of `clients`' pools (one per node; the home pool first), the one
    holding the longest run, the first on a tie. Returns the blocks it holds a reference on,
    for the caller to release (`KVCacheManager.release_blocks`, engine thread) once the
    prefill is done."""
    limit = (len(prompt_ids) - 1) // end.layout.block_size   # never the last token's block
    live = [c for c in clients if not c.dead]
    # Our own hits and the pools' at once: one round trip on the way to the prefill.
    local, *found = await asyncio.gather(
        end.loop.call(lambda e: e.kv.hold_cached_prefix(prompt_ids, salt)),
        *[c.lookup(keys[:limit]) for c in live], return_exceptions=True)
    if isinstance(local, BaseException):
        raise local
    first = len(local)
    counts = [n if isinstance(n, int) else 0 for n in found]
    if not counts or max(counts) <= first:
        return local
    client = live[counts.index(max(counts))]
    fresh: list[Block] = []
    got = 0
    try:
        fresh = await end.loop.call(lambda e: e.kv.blocks_for_import(max(counts) - first))
        if fresh:
            got = await client.get(keys[first:first + len(fresh)], [b.block_id for b in fresh])
    except TransferError as e:
        log.warning("prefix reuse from the KV pool failed (%s); computing the prompt", e)
        got = 0
    read, unused = fresh[:got], fresh[got:]

    def adopt(engine) -> None:
        engine.kv.cache_imported(prompt_ids, first, read, salt)
        engine.kv.release_blocks(unused)
    if fresh:
        await end.loop.call(adopt)
    return local + read
