"""The shape of an engine's KV cache: what two engines must agree on to exchange blocks."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One tensor per engine: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].

    A block of one layer's K (or V) is contiguous, and so are consecutive block ids, which is
    what lets transports merge runs of blocks into single transfers.
    """

    model: str
    dtype: str            # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why blocks cannot move between the two KV caches (None if they can); their sizes
        may differ."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine
                 if k != "num_blocks" and mine[k] != theirs[k]]
        return "; ".join(diffs) or None
