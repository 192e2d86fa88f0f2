"""Prompt-lookup proposals: no model, just the sequence's own tokens.

The last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are searched for in
the earlier tokens of prompt + output; the k tokens that followed their latest earlier match
are proposed (the latest match followed by k tokens, else the latest). Text that copies from its prompt (quoting, editing, "repeat this") is predicted
for free; elsewhere nothing matches and nothing is proposed.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens of `tokens` (empty: no n-gram of the tail recurs)."""
    seq = np.asarray(tokens, dtype=np.int64)
    size = len(seq)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = seq[size - n:]
        # Windows starting before the tail itself: seq[i:i+n] for i in [0, size - n).
        windows = sliding_window_view(seq[:size - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            # The latest match (the most recent context) among those followed by k tokens.
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[-1]) + n
            return seq[start:start + k].tolist()
    return []
