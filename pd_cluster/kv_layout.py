"""The shape of an engine's KV cache: what two engines must agree on to exchange blocks."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

# Fields two KV caches may differ in and still exchange blocks: their size, and which window
# of the model's KV heads each holds (tensor-parallel shards; the transport moves head slices).
_PER_CACHE = frozenset({"num_blocks", "num_kv_heads", "head_start"})


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One tensor per KV cache (shard): [num_layers, 2 (K, V), num_blocks, block_size,
    num_kv_heads, head_dim].

    A block of one layer's K (or V) is contiguous, and so are consecutive block ids, which is
    what lets transports merge runs of blocks into single transfers.

    A tensor-parallel engine of N ranks keeps N such tensors (shards), one per rank, all with
    the same block ids; rank r's holds the model's KV heads [head_start, head_start +
    num_kv_heads) of `total_kv_heads`. With fewer KV heads than ranks several shards hold the
    same head (replicated). `total_kv_heads` 0 means num_kv_heads (an unsharded cache), and is
    normalised to it, so a layout built without the two shard fields is the whole cache.
    """

    model: str
    dtype: str            # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int     # heads in this tensor (the shard's window)
    head_dim: int
    head_start: int = 0   # the model's index of this tensor's first KV head
    total_kv_heads: int = 0  # the model's KV heads (0: num_kv_heads, i.e. unsharded)

    def __post_init__(self) -> None:
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if (self.num_kv_heads < 1 or self.head_start < 0
                or self.head_start + self.num_kv_heads > self.total_kv_heads):
            raise ValueError(f"KV heads [{self.head_start}, {self.head_start + self.num_kv_heads})"
                             f" are not within the model's {self.total_kv_heads}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def heads(self) -> range:
        """The model's KV heads this tensor holds."""
        return range(self.head_start, self.head_start + self.num_kv_heads)

    @property
    def is_shard(self) -> bool:
        return self.num_kv_heads != self.total_kv_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one token (head_dim elements)."""
        return self.head_dim * self.torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    def whole(self) -> "KVLayout":
        """The layout of an unsharded KV cache of the same blocks: every KV head."""
        return replace(self, num_kv_heads=self.total_kv_heads, head_start=0)

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why blocks cannot move between the two KV caches (None if they can); their sizes
        and head windows may differ (the transport moves the heads both hold)."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine
                 if k not in _PER_CACHE and mine[k] != theirs[k]]
        return "; ".join(diffs) or None
