"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, caching, release.

The scheduler sees only this class; the block allocator's internals stay behind it.
On a decode engine whose prompts another engine writes, `enable_quarantine` fences the
written blocks of a request that ends before its KV landed (pd_cluster/kv_cache_quarantine.py).
"""
from __future__ import annotations

from pd_cluster.block_allocator import (Block, BlockAllocator, hash_block, prefix_block_hashes,
                                       salt_root)
from pd_cluster.kv_cache_quarantine import KVQuarantine
from pd_cluster.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of each request's full blocks
        # Requests whose blocks a launched step may still be writing (count of such steps), and
        # blocks freed meanwhile: they return to the allocator only once those steps are done, so a
        # late write can never land in a block that has a new owner.
        self._writing: dict[str, int] = {}
        self._deferred: dict[str, list[Block]] = {}
        self.quarantine: KVQuarantine | None = None   # see enable_quarantine

    def enable_quarantine(self, window_s: float) -> KVQuarantine:
        """From now on, blocks a peer writes for a request (`free(..., written_from=)`) wait
        in a quarantine until the peer confirms its writes drained, or for `window_s` (the
        peer's lease plus a margin). Engine thread; returns the quarantine, whose
        `drained(key)` any thread may call."""
        if self.quarantine is None:
            self.quarantine = KVQuarantine(window_s)
        self.quarantine.window_s = window_s
        return self.quarantine

    def settle_quarantine(self) -> None:
        """Free the quarantined blocks whose writer confirmed, or whose deadline passed."""
        if self.quarantine is not None:
            for _, _, blocks in self.quarantine.settle():
                self.allocator.release(blocks)

    @property
    def num_free_blocks(self) -> int:
        # Read after every step and while idle (the load report): quarantined blocks come
        # back here even when no request asks for blocks.
        self.settle_quarantine()
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        The hit never covers the last token: that token must be computed to get logits.
        """
        hits = self._cached_prefix(request.all_token_ids, request.params.cache_salt)
        return hits, len(hits) * self.block_size

    def _cached_prefix(self, tokens, salt: str | None) -> list[Block]:
        bs = self.block_size
        hits: list[Block] = []
        parent = salt_root(salt)
        for start in range(0, (len(tokens) - 1) // bs * bs, bs):
            chunk = tokens[start:start + bs]
            parent = hash_block(parent, chunk)
            block = self.allocator.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- importing a prompt's prefix blocks from elsewhere (the KV pool) ---------------------
    # Engine thread. The prefill side reads the blocks of a prompt's prefix that the KV pool
    # holds into blocks of its own, indexes them as cached, and keeps a reference on them
    # until the prompt is prefilled: the scheduler then finds them as a prefix-cache hit, so
    # chunked prefill starts after them and they count in num_cached_tokens.
    def hold_cached_prefix(self, token_ids, salt: str | None = None) -> list[Block]:
        """Take a reference on the full blocks of `token_ids` (under cache salt `salt`)
        cached here (never the last token's), so no eviction takes them before the prompt is
        scheduled."""
        hits = self._cached_prefix(token_ids, salt)
        self.allocator.touch(hits)
        return hits

    def blocks_for_import(self, count: int) -> list[Block]:
        """`count` fresh blocks (one reference each) to read prefix blocks into; [] when
        fewer than that are free (an import never preempts)."""
        if count <= 0 or count > self.allocator.num_free:
            return []
        return self.allocator.allocate(count)

    def cache_imported(self, token_ids, first: int, blocks: list[Block],
                       salt: str | None = None) -> None:
        """`blocks` now hold the full blocks first, first + 1, ... of `token_ids`: index them
        under their chained hashes, salted by `salt` (the caller still holds them:
        release_blocks)."""
        if not blocks:
            return
        bs = self.block_size
        hashes = prefix_block_hashes(token_ids[:(first + len(blocks)) * bs], bs, salt)
        for i, block in enumerate(blocks, start=first):
            self.allocator.cache(block, hashes[i], token_ids[i * bs:(i + 1) * bs])

    def release_blocks(self, blocks: list[Block]) -> None:
        """Drop the references hold_cached_prefix / blocks_for_import took (tail first)."""
        self.allocator.release(list(reversed(blocks)))

    def can_allocate(self, request: Request, num_new_tokens: int,
                     cached: list[Block] | None = None) -> bool:
        cached = cached or []
        have = len(request.block_ids) + len(cached)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - have
        # Cached blocks sitting in the free queue are about to be revived, not available.
        revived = sum(1 for b in cached if b.ref_count == 0)
        return need <= self.num_free_blocks - revived

    def allocate(self, request: Request, num_new_tokens: int,
                 cached: list[Block] | None = None) -> None:
        """Give the request blocks for `num_new_tokens` more tokens (call can_allocate first)."""
        blocks = self._blocks.setdefault(request.request_id, [])
        if cached:
            self.allocator.touch(cached)
            blocks.extend(cached)
            request.block_ids.extend(b.block_id for b in cached)
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if need > 0:
            new = self.allocator.allocate(need)
            blocks.extend(new)
            request.block_ids.extend(b.block_id for b in new)

    def cache_computed_blocks(self, request: Request) -> None:
        """Index every block whose tokens are now all computed, chaining hashes."""
        if not self.allocator.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        full = request.num_computed_tokens // bs
        if full <= len(hashes):  # the common decode step: no block filled up
            return
        blocks = self._blocks.get(request.request_id, [])
        for i in range(len(hashes), min(full, len(blocks))):
            chunk = request.token_slice(i * bs, (i + 1) * bs)
            parent = hashes[-1] if hashes else salt_root(request.params.cache_salt)
            hashes.append(hash_block(parent, chunk))
            self.allocator.cache(blocks[i], hashes[-1], chunk)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens (speculative
        decoding: the blocks allocated for drafts that verification rejected). Those blocks
        were never hashed: only blocks of computed, kept tokens are."""
        blocks = self._blocks.get(request.request_id, [])
        keep = self.blocks_needed(num_tokens)
        if len(blocks) <= keep:
            return
        dropped = blocks[keep:]
        del blocks[keep:]
        del request.block_ids[keep:]
        dropped.reverse()
        if request.request_id in self._writing:
            self._deferred.setdefault(request.request_id, []).extend(dropped)
        else:
            self.allocator.release(dropped)

    def free(self, request: Request, written_from: int | None = None) -> None:
        """Release the request's blocks, tail first so a prefix outlives its suffix in cache.

        `written_from`: a peer was writing the request's blocks from this index on (those
        past its prefix-cache hit) and may still be: with the quarantine enabled, they wait
        there under the request id instead of returning to the free list.
        """
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        if written_from is not None and self.quarantine is not None:
            # The prefix hits before `written_from` are shared and never written by the peer.
            self.quarantine.hold(rid, blocks[written_from:])
            blocks = blocks[:written_from]
        blocks.reverse()
        self._hashes.pop(rid, None)
        request.block_ids = []
        if rid in self._writing:
            self._deferred.setdefault(rid, []).extend(blocks)
        else:
            self.allocator.release(blocks)

    def step_launched(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._writing[rid] = self._writing.get(rid, 0) + 1

    def step_done(self, request_ids: list[str]) -> None:
        """A launched step has finished on the device: release what was freed meanwhile."""
        for rid in request_ids:
            left = self._writing.pop(rid) - 1
            if left:
                self._writing[rid] = left
            elif rid in self._deferred:
                self.allocator.release(self._deferred.pop(rid))
