"""The tensor-parallel group of this process, its collectives, and how a model splits over it.

One process per rank; `init_tp` joins them. Until then (and in every single-device engine)
`get_tp()` is rank 0 of 1 and every collective returns its input untouched, so the tp = 1 path
pays nothing for tensor parallelism.

Two groups over the same ranks: `device_group` (the WORLD group: NCCL on GPU, gloo on CPU)
moves tensors of the forward pass; `cpu_group` (always gloo) moves pickled Python objects,
which NCCL cannot carry without a round trip through the device. On GPUs that can map each
other's memory, decode-sized all-reduces skip NCCL (`peer`: pd_cluster/peer_all_reduce.py).

One tensor-parallel engine per process at a time: its ranks hold the process's default
group, which `destroy_tp` (the engine's close) gives back for the next one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from pd_cluster.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None   # tensors of the forward pass (None at size 1)
    cpu_group: Any = None      # Python objects, over gloo (None at size 1)
    peer: Any = None           # PeerAllReduce for small all-reduces (None: NCCL for all)


_tp = TPGroup()


def get_tp() -> TPGroup:
    """This process's tensor-parallel group (rank 0 of 1 until `init_tp`)."""
    return _tp


def init_tp(rank: int, size: int, init_method: str, backend: str,
            timeout_s: float = 60.0) -> TPGroup:
    """Join the group of `size` ranks as `rank` (every rank calls this; it returns when all
    have). `timeout_s` also bounds every later collective: a dead rank fails the others
    instead of hanging them."""
    global _tp
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(
        list(range(size)), timeout=timedelta(seconds=timeout_s), backend="gloo")
    _tp = TPGroup(rank, size, device_group, cpu_group)
    return _tp


def check_no_group() -> None:
    """Raise if this process already holds a tensor-parallel engine's group (before a new
    engine starts any rank)."""
    if dist.is_initialized():
        raise RuntimeError("this process already runs a tensor-parallel engine: close it first "
                           "(LLM.close(), `with LLM(...) as llm:`, or drop every reference to "
                           "it); one tensor-parallel engine per process at a time")


def enable_peer_all_reduce(devices: list[torch.device], wanted: bool = True) -> bool:
    """Collective over the group's GPUs (`devices`, in rank order): route small all-reduces
    through peer memory if every rank can map every other's GPU (and `wanted`); else, or if
    any rank cannot, all stay on NCCL. Also starts NCCL's communicator, so that CUDA graph
    capture finds it made. Returns whether the peer path is on."""
    global _tp
    from pd_cluster.peer_all_reduce import PeerAllReduce, PeerUnavailable, peers_reachable

    dist.all_reduce(torch.zeros(1, device=devices[_tp.rank]), group=_tp.device_group)
    votes: list[Any] = [None] * _tp.size
    dist.all_gather_object(votes, wanted and peers_reachable(devices[_tp.rank], devices),
                           group=_tp.cpu_group)
    if not all(votes):
        if wanted:
            logger.info("tensor parallel: NCCL for every all-reduce (not every pair of GPUs "
                        "can map each other's memory)")
        return False
    try:
        peer = PeerAllReduce(_tp.rank, _tp.size, devices[_tp.rank], _tp.cpu_group)
    except PeerUnavailable as e:
        logger.warning("tensor parallel: NCCL for every all-reduce; peer memory failed: %s", e)
        return False
    _tp = replace(_tp, peer=peer)
    return True


def destroy_tp() -> None:
    """Leave the group; `get_tp()` is rank 0 of 1 again."""
    global _tp
    if _tp.peer is not None:
        _tp.peer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp = TPGroup()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place; x itself at size 1."""
    if _tp.size > 1:
        if _tp.peer is not None and _tp.peer.fits(x):
            return _tp.peer(x)
        dist.all_reduce(x, group=_tp.device_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x joined along `dim` in rank order: [..., n, ...] -> [..., size * n, ...]."""
    if _tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x, group=_tp.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_tensor(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite t with rank `src`'s t (same shape and dtype on every rank), in place."""
    if _tp.size > 1:
        dist.broadcast(t, src=src, group=_tp.device_group)
    return t


def kv_head_shard(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(KV heads this rank holds, the first one's global index).

    At least as many KV heads as ranks: an even split. Fewer: each rank holds one, replicated
    over the tp_size // num_kv_heads ranks whose query heads share it (rank r's query heads
    are r * H / tp ... and belong to the group of KV head r * num_kv_heads // tp_size)."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) is not divisible by the tensor "
                             f"parallel size ({tp_size})")
        local = num_kv_heads // tp_size
        return local, rank * local
    if tp_size % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) is fewer than the tensor parallel size "
                         f"({tp_size}) and does not divide it, so KV heads cannot be replicated "
                         f"evenly")
    return 1, rank * num_kv_heads // tp_size


def check_tp(cfg: ModelConfig, tp_size: int, expert_parallel: bool = False) -> None:
    """Raise a ValueError naming every shape of `cfg` that cannot be split over tp_size ranks.
    (The vocabulary needs no check: it is padded to a multiple of tp_size.) A mixture of
    experts splits each expert's intermediate dimension, or with `expert_parallel` the
    experts themselves (pd_cluster/models/moe.py)."""
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, not {tp_size}")
    problems = []
    if cfg.num_heads % tp_size:
        problems.append(f"num_attention_heads ({cfg.num_heads}) is not divisible by the "
                        f"tensor parallel size ({tp_size})")
    try:
        kv_head_shard(cfg.num_kv_heads, tp_size, 0)
    except ValueError as e:
        problems.append(str(e))
    if cfg.has_dense_layers and cfg.intermediate_size % tp_size:
        problems.append(f"intermediate_size ({cfg.intermediate_size}) is not divisible by the "
                        f"tensor parallel size ({tp_size})")
    if cfg.num_experts and expert_parallel and cfg.num_experts % tp_size:
        problems.append(f"num_experts ({cfg.num_experts}) is not divisible by the expert "
                        f"parallel size ({tp_size})")
    if cfg.num_experts and not expert_parallel and cfg.moe_intermediate_size % tp_size:
        problems.append(f"the experts' intermediate size ({cfg.moe_intermediate_size}) is not "
                        f"divisible by the tensor parallel size ({tp_size}); "
                        f"enable_expert_parallel splits whole experts instead")
    if problems:
        raise ValueError(f"cannot split {cfg.architecture} over {tp_size} ranks: "
                         + "; ".join(problems))
