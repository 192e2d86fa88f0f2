"""A KV cache made of head-window shards, and which shard's bytes feed which.

A tensor-parallel engine keeps its KV cache as one tensor per rank (`KVLayout`: the same
blocks, a window of the model's KV heads each). One transport registers all of them; its
byte offsets (the `Copy` triples of transfer/runs.py) count over their virtual
concatenation, shard 0 first:

    | shard 0: [L, 2, B, bs, H0, d] | shard 1: [L, 2, B, bs, H1, d] | ...
    0                               starts[1]                       starts[2]

and each backend maps an offset back to its shard (`locate`). An unsharded KV cache is the
one-shard case, with offsets exactly as before.

Who feeds whom (`head_sources`): for every destination shard and every head of its window,
the first source shard (in shard order) holding that head; replicated heads are thus read
from one shard, and written once into every destination shard that holds them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pd_cluster.kv_layout import KVLayout


def check_shards(layouts: Sequence[KVLayout]) -> str | None:
    """Why `layouts` cannot be the shards of one KV cache (None if they can): they must agree
    on everything but the head window, have the same blocks, and hold every KV head."""
    if not layouts:
        return "no KV cache shards"
    first = layouts[0]
    for i, lay in enumerate(layouts[1:], 1):
        why = first.mismatch(lay)
        if why:
            return f"shard {i} differs from shard 0: {why}"
        if lay.num_blocks != first.num_blocks:
            return f"shard {i} has {lay.num_blocks} blocks, shard 0 {first.num_blocks}"
    held = np.zeros(first.total_kv_heads, dtype=bool)
    for lay in layouts:
        held[lay.head_start:lay.head_start + lay.num_kv_heads] = True
    if not held.all():
        return (f"KV heads {np.flatnonzero(~held)[:8].tolist()} of {first.total_kv_heads} are "
                f"in no shard")
    return None


def starts(layouts: Sequence[KVLayout]) -> np.ndarray:
    """Each shard's first byte in the virtual concatenation (int64), and the total at the end."""
    return np.concatenate(([0], np.cumsum([lay.nbytes for lay in layouts]))).astype(np.int64)


def outside(bounds: np.ndarray, runs: np.ndarray) -> bool:
    """Whether any (offset, length) run of `runs` ([n, 2]) is not within one shard (`bounds`:
    `starts`' result): offsets from a peer must not reach past the shard they name."""
    if not len(runs):
        return False
    off, n = runs[:, 0], runs[:, 1]
    shard = np.searchsorted(bounds, off, side="right") - 1
    return bool(((off < 0) | (n < 0) | (shard >= len(bounds) - 1)
                 | (off + n > bounds[np.minimum(shard + 1, len(bounds) - 1)])).any())


@dataclass(frozen=True, slots=True)
class Segment:
    """Heads [head, head + count) of destination shard `dst` come from source shard `src`."""

    src: int
    dst: int
    head: int
    count: int

    def whole(self, src: Sequence[KVLayout], dst: Sequence[KVLayout]) -> bool:
        """Both shards' windows are exactly these heads: whole blocks move."""
        s, d = src[self.src], dst[self.dst]
        return (s.head_start == d.head_start == self.head
                and s.num_kv_heads == d.num_kv_heads == self.count)


def head_sources(src: Sequence[KVLayout], dst: Sequence[KVLayout]) -> list[Segment]:
    """For every destination shard, its window split into runs of heads that each come from
    one source shard (the first holding them). A loop over heads, run once per peer and
    direction (transports cache it), not per transfer."""
    out = []
    for d, lay in enumerate(dst):
        for h in lay.heads:
            s = next((i for i, sl in enumerate(src) if h in sl.heads), None)
            if s is None:
                raise ValueError(f"KV head {h} of destination shard {d} is in no source shard")
            prev = out[-1] if out else None
            if prev is not None and (prev.dst, prev.src, prev.head + prev.count) == (d, s, h):
                out[-1] = Segment(s, d, prev.head, prev.count + 1)
            else:
                out.append(Segment(s, d, h, 1))
    return out
