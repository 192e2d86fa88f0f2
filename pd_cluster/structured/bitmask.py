"""Batched token masks on the device: bit j of word w of a row allows token 32 * w + j."""
from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per mask row for `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[rows[k], t] to -inf wherever bit t of bitmask[k] is 0; in place.

    logits: [S, V] float; rows: [R] long; bitmask: [R, ceil(V / 32)] int32, all on one device.
    One unpack and one masked fill for the whole batch, whatever R is.
    """
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32,
                                                       device=logits.device)
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
