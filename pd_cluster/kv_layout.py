"""The shape of an engine's KV cache: what two engines must agree on to exchange blocks."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

# Fields two KV caches may differ in and still exchange blocks: their size, and which window
# of the model's KV heads each holds (tensor-parallel shards; the transport moves head slices).
_PER_CACHE = frozenset({"num_blocks", "num_kv_heads", "head_start"})


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One tensor per KV cache (shard): [num_layers, parts, num_blocks, block_size,
    num_kv_heads, head_dim], parts 2 (K, V), or 1 for a `latent` cache.

    A latent cache (multi-head latent attention, DeepSeek-V2/V3) holds per token and layer
    one vector: the normalised latent c (kv_lora_rank values) then the rotated RoPE key k_pe
    (qk_rope_head_dim), as one "head" (num_kv_heads 1, head_dim L + R); every query head
    reads it. Blocks of it are runs of bytes as a K or V block is, so transports move it as
    any cache, with `parts` regions per layer instead of 2:

        [layer 0: | b0 | b1 | ... ] [layer 1: | b0 | b1 | ... ] ...     (no V region)

    A block of one layer's K (or V) is contiguous, and so are consecutive block ids, which is
    what lets transports merge runs of blocks into single transfers.

    A tensor-parallel engine of N ranks keeps N such tensors (shards), one per rank, all with
    the same block ids; rank r's holds the model's KV heads [head_start, head_start +
    num_kv_heads) of `total_kv_heads`. With fewer KV heads than ranks several shards hold the
    same head (replicated). `total_kv_heads` 0 means num_kv_heads (an unsharded cache), and is
    normalised to it, so a layout built without the two shard fields is the whole cache.

    A latent cache is replicated, never split: its one head is on every attention rank
    (each rank computes the same latent; only the query heads split). So P at tp=a -> D at
    tp=b needs no mapping of heads: every D rank's shard takes head 0 from P's first shard
    (transfer/shards.py head_sources picks the first source holding a head), i.e. a
    receiver needs one sender's copy, and the other P ranks' copies are never read.

    `dtype` "float8_e4m3fn" (kv_cache_dtype fp8) comes with `kv_scales`: per layer a (K
    scale, V scale) pair, a stored value meaning fp8 * scale (pd_cluster/kv_scales.py).
    Both are part of what two caches must agree on: blocks of different dtypes or scales
    mean different numbers.
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
    kv_scales: tuple[tuple[float, float], ...] = ()   # fp8: per layer (K, V); else empty
    latent: bool = False  # one latent entry per token and layer (MLA) instead of K and V

    def __post_init__(self) -> None:
        # Tuples of floats however they came (msgpack hands lists back), so layouts compare.
        object.__setattr__(self, "kv_scales",
                           tuple((float(k), float(v)) for k, v in self.kv_scales))
        if self.kv_scales and len(self.kv_scales) != self.num_layers:
            raise ValueError(f"{len(self.kv_scales)} layers of KV scales for "
                             f"{self.num_layers} layers")
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if self.latent and (self.kv_scales or self.total_kv_heads != 1):
            raise ValueError("a latent KV cache has one head (c and k_pe together) and no "
                             "fp8 scales")
        if (self.num_kv_heads < 1 or self.head_start < 0
                or self.head_start + self.num_kv_heads > self.total_kv_heads):
            raise ValueError(f"KV heads [{self.head_start}, {self.head_start + self.num_kv_heads})"
                             f" are not within the model's {self.total_kv_heads}")

    @property
    def parts(self) -> int:
        """Tensors per layer: K and V (2), or the latent (1)."""
        return 1 if self.latent else 2

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.parts, self.num_blocks, self.block_size, self.num_kv_heads,
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
        """Bytes of one block of one layer's K (or V, or latent)."""
        return self.block_size * self.num_kv_heads * self.head_bytes

    @property
    def bytes_per_block_id(self) -> int:
        """Bytes one block id holds over every layer (K and V, or the latent)."""
        return self.num_layers * self.parts * self.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.num_blocks * self.bytes_per_block_id

    def whole(self) -> "KVLayout":
        """The layout of an unsharded KV cache of the same blocks: every KV head."""
        return replace(self, num_kv_heads=self.total_kv_heads, head_start=0)

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why blocks cannot move between the two KV caches (None if they can); their sizes
        and head windows may differ (the transport moves the heads both hold). Mine first:
        "dtype: 'bfloat16' != 'float8_e4m3fn'"."""
        mine, theirs = asdict(self), asdict(other)
        diffs = []
        for k in mine:
            if k in _PER_CACHE or mine[k] == theirs[k]:
                continue
            if k == "dtype":
                diffs.append(f"KV cache dtype: {self.dtype!r} != {other.dtype!r} (kv_cache_dtype "
                             f"must be the same on both engines)")
            elif k == "kv_scales":
                if self.dtype == other.dtype:      # else the dtype says it all
                    diffs.append(_scales_differ(self.kv_scales, other.kv_scales))
            else:
                diffs.append(f"{k}: {mine[k]!r} != {theirs[k]!r}")
        return "; ".join(diffs) or None


def _scales_differ(mine: tuple, theirs: tuple) -> str:
    """The first differing layer of two fp8 caches' scales, briefly (80 layers' worth would
    drown the message)."""
    if len(mine) != len(theirs):
        return f"KV scales: {len(mine)} layers != {len(theirs)}"
    layers = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    i = layers[0]
    return (f"fp8 KV scales differ in {len(layers)} of {len(mine)} layers, first layer {i}: "
            f"(K, V) {mine[i]} != {theirs[i]} (both engines must use the same checkpoint "
            f"scales or calibrate alike)")
