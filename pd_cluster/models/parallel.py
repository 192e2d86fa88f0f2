"""Tensor-parallel linear and embedding layers (Megatron's split of a transformer block).

Over `tp` ranks (`pd_cluster.distributed.get_tp()`, read when a layer is built):

    qkv_proj, gate_up_proj   column-parallel: output features split, no communication
    o_proj, down_proj        row-parallel: input features split, partial outputs summed
    embed_tokens             vocabulary rows split: each rank embeds the ids it owns, zeros
                             for the others, then a sum
    lm_head                  vocabulary rows split: each rank's logits gathered, so every rank
                             gets the full vocabulary

so a decoder layer communicates twice (after o_proj and after down_proj).

Each parameter carries `weight_loader(param, loaded, shard_id=None)`, which copies this rank's
slice of a full checkpoint tensor in, and `full_shape`, the shape of that full tensor (what a
random initialisation draws so that every rank's slice belongs to one model). At tp = 1 each
layer is the plain layer: the shapes of today, `ops.linear`, no collective, no extra copy.

FP8 (`quantization="fp8"`, the four linear layers of a decoder layer; the embedding and
lm_head stay 16-bit): `weight` is float8_e4m3fn [out, in] and `weight_scale` float32 [out],
one scale per output channel, and the GEMM is `fp8.fp8_linear` (per-token activation
scales). The weight loader takes either kind of checkpoint tensor:
  - 16-bit: quantized at load, per output channel, after the rank's slice is taken: a
    column-parallel rank's rows are whole rows, so its w8 and scales are exactly those rows
    of the unsplit layer's; a row-parallel rank quantizes its columns with the scales of the
    whole rows (from the full tensor every rank is handed), so its w8 is exactly its slice.
  - FP8 (an FP8 checkpoint): copied as is; `weight_scale` then comes from the checkpoint,
    per channel ([out] or [out, 1]) or per tensor ([] or [1], expanded over the rows; in a
    packed layer each shard's own scale over that shard's rows).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_math import FP8
from pd_cluster.distributed import all_gather, all_reduce, get_tp, kv_head_shard
from pd_cluster.models import fp8, ops

WeightLoader = Callable[..., None]


def _check_fits(param: torch.Tensor, loaded: torch.Tensor,
                expected: Sequence[int] | None = None) -> None:
    # copy_ would broadcast a wrong-shaped tensor silently.
    expected = tuple(param.shape if expected is None else expected)
    if tuple(loaded.shape) != expected:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter of full shape {expected}")


def _split(n: int, tp_size: int) -> int:
    """n / tp_size, which must be whole (`distributed.check_tp` says why not, earlier)."""
    if n % tp_size:
        raise ValueError(f"{n} does not split over {tp_size} ranks")
    return n // tp_size


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: object = None) -> None:
    """The whole tensor, as is (norms, replicated biases)."""
    _check_fits(param, loaded)
    param.copy_(loaded)


def _parameter(shape: Sequence[int], full_shape: Sequence[int],
               loader: WeightLoader = default_weight_loader,
               dtype: torch.dtype | None = None) -> nn.Parameter:
    # Uninitialised: load_weights or the dummy initialisation fills every parameter.
    p = nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    p.full_shape = tuple(full_shape)
    return p


def _is_fp8(quantization: str | None) -> bool:
    if quantization not in (None, "fp8"):
        raise ValueError(f"unsupported quantization {quantization!r} (fp8 or None)")
    return quantization == "fp8"


def _scale_rows(loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight_scale as [rows] float32: a per-tensor scale expanded over the
    rows, a per-channel one ([rows] or [rows, 1]) flattened."""
    loaded = loaded.float().reshape(-1)
    if loaded.numel() == 1:
        return loaded.expand(rows)
    if loaded.numel() != rows:
        raise ValueError(f"checkpoint weight_scale of {loaded.numel()} values fits neither "
                         f"per-tensor (1) nor per-channel ({rows}) scaling")
    return loaded


def _linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.fp8:
        return fp8.fp8_linear(x, layer.weight, layer.weight_scale, bias)
    return ops.linear(x, layer.weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over the ranks.

    x [T, in] (the same on every rank) -> y [T, out_local], this rank's output features.

    The output may pack several logical matrices ("shards": q/k/v, gate/up), each split
    separately so that every rank holds a piece of each: rank r's weight is
    [shard 0's piece; shard 1's piece; ...]. `_pieces()` says which rows those are.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quantization: str | None = None):
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features = in_features
        # (rows of the full shard, first row of this rank's piece in it, rows of the piece)
        self.pieces = self._pieces(out_features)
        full = sum(p[0] for p in self.pieces)
        local = sum(p[2] for p in self.pieces)
        self.out_features = local
        self.fp8 = _is_fp8(quantization)
        self.weight = _parameter((local, in_features), (full, in_features), self.weight_loader,
                                 FP8 if self.fp8 else None)
        self.weight_scale = _parameter((local,), (full,), self.weight_loader,
                                       torch.float32) if self.fp8 else None
        self.bias = _parameter((local,), (full,), self.weight_loader) if bias else None

    def _pieces(self, out_features: int) -> list[tuple[int, int, int]]:
        local = _split(out_features, self.tp_size)
        return [(out_features, self.tp_rank * local, local)]

    def _shard_index(self, shard_id: object) -> int:
        return 0 if shard_id is None else int(shard_id)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        """Copy this rank's rows of one shard (`shard_id`), or of every shard when `loaded` is
        the whole packed tensor (shard_id None). Works for the weight, its scales and the bias
        alike; a 16-bit weight of an FP8 layer is quantized (module docstring)."""
        if param is self.weight_scale:
            rows = (sum(p[0] for p in self.pieces) if shard_id is None
                    else self.pieces[self._shard_index(shard_id)][0])
            loaded = _scale_rows(loaded, rows)
        if shard_id is None and len(self.pieces) > 1:
            for i, part in enumerate(loaded.split([p[0] for p in self.pieces], dim=0)):
                self._load_piece(param, part, i)
            return
        self._load_piece(param, loaded, self._shard_index(shard_id))

    def _load_piece(self, param: torch.Tensor, loaded: torch.Tensor, i: int) -> None:
        full, start, rows = self.pieces[i]
        if loaded.shape[0] != full or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"shard {i} of a parameter of shape "
                             f"{(full,) + tuple(param.shape[1:])}")
        offset = sum(p[2] for p in self.pieces[:i])
        piece = loaded.narrow(0, start, rows)
        if param is self.weight and self.fp8 and piece.dtype != FP8:
            w8, scale = fp8.quantize_weight(piece.to(param.device))
            param.narrow(0, offset, rows).copy_(w8)
            self.weight_scale.narrow(0, offset, rows).copy_(scale)
            return
        param.narrow(0, offset, rows).copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices of one input in one matmul (gate_up: shards 0 and 1).
    y [T, sum(out_sizes) / tp] = [piece of shard 0 | piece of shard 1 | ...]."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool,
                 quantization: str | None = None):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, quantization)

    def _pieces(self, out_features: int) -> list[tuple[int, int, int]]:
        return [(n, self.tp_rank * _split(n, self.tp_size), _split(n, self.tp_size))
                for n in self.out_sizes]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul: y [T, (heads + 2 * kv_heads) * head_dim] of this
    rank's query heads (num_heads / tp of them) and its KV heads (split, or replicated when
    there are fewer KV heads than ranks: see `kv_head_shard`). Shards "q", "k", "v" (or 0-2)."""

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, quantization: str | None = None):
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias,
                         quantization)
        # This rank's counts: what its attention and its KV cache see.
        self.num_heads = self.pieces[0][2] // head_dim
        self.num_kv_heads = self.pieces[1][2] // head_dim

    def _pieces(self, out_features: int) -> list[tuple[int, int, int]]:
        d = self.head_dim
        heads = _split(self.total_heads, self.tp_size)
        kv_heads, first_kv = kv_head_shard(self.total_kv_heads, self.tp_size, self.tp_rank)
        kv = (self.total_kv_heads * d, first_kv * d, kv_heads * d)
        return [(self.total_heads * d, self.tp_rank * heads * d, heads * d), kv, kv]

    def _shard_index(self, shard_id: object) -> int:
        return self.SHARDS.index(shard_id) if isinstance(shard_id, str) else int(shard_id)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over the ranks.

    x [T, in / tp] (this rank's features, as a column-parallel layer left them) -> y [T, out],
    the sum of every rank's partial product, on every rank (with `reduce_results=False`, this
    rank's partial product: the layer after it sums them). The bias is added once, after the
    sum (adding it on each rank would count it tp times)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quantization: str | None = None, reduce_results: bool = True):
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        # False: return this rank's partial product; the RMSNorm after it sums the ranks'
        # (in one kernel with its residual add where it can: ops.all_reduce_rms_norm).
        self.reduce_results = reduce_results or tp.size == 1
        if bias and not self.reduce_results:
            raise ValueError("a row-parallel layer with a bias must reduce its own results")
        self.in_features, self.in_local = in_features, _split(in_features, tp.size)
        self.fp8 = _is_fp8(quantization)
        self.weight = _parameter((out_features, self.in_local), (out_features, in_features),
                                 self.weight_loader, FP8 if self.fp8 else None)
        self.weight_scale = _parameter((out_features,), (out_features,), self.weight_loader,
                                       torch.float32) if self.fp8 else None
        self.bias = _parameter((out_features,), (out_features,)) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        if param is self.weight_scale:      # per output row: the same on every rank
            param.copy_(_scale_rows(loaded, param.shape[0]))
            return
        _check_fits(param, loaded, (param.shape[0], self.in_features))
        columns = (1, self.tp_rank * self.in_local, self.in_local)   # this rank's: narrow()
        if param is self.weight and self.fp8 and loaded.dtype != FP8:
            # Quantized with the whole rows' scales (module docstring).
            full = loaded.to(param.device)
            w8, scale = fp8.quantize_weight(full.narrow(*columns), fp8.row_scales(full))
            param.copy_(w8)
            self.weight_scale.copy_(scale)
            return
        param.copy_(loaded.narrow(*columns))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return _linear(self, x, self.bias)
        if not self.reduce_results:
            return _linear(self, x, None)
        y = all_reduce(_linear(self, x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary's rows split over the ranks.

    The vocabulary is padded to a multiple of tp (padding rows are zero); rank r holds rows
    [r * rows, (r + 1) * rows). ids [T] -> [T, dim]: each rank looks up the ids it holds, zeros
    for the rest, and the sum over the ranks is every id's row."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows
        self.weight = _parameter((self.rows, embedding_dim), (num_embeddings, embedding_dim),
                                 self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        _check_fits(param, loaded, (self.num_embeddings, param.shape[1]))
        n = max(0, min(self.rows, self.num_embeddings - self.start))   # real rows held here
        param[:n].copy_(loaded[self.start:self.start + n])
        param[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        foreign = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        return all_reduce(out.masked_fill_(foreign.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (whose weight it may
    share: the same rows sit on the same rank)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, dim] -> logits [S, vocab] over the full vocabulary, on every rank."""
        logits = ops.linear(hidden, self.weight, None)
        if self.tp_size == 1:
            return logits
        logits = all_gather(logits, dim=-1)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., :self.num_embeddings].contiguous()   # drop the padding
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
