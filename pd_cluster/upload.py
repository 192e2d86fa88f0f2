"""Small host values onto the device without waiting for the device's queued work."""
from __future__ import annotations

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`; on a GPU the copy is queued behind the stream's work.

    The host side is pinned (from PyTorch's caching host allocator, which keeps the block
    until the copy has run): a copy from pinned memory is one DMA that the host only queues,
    where a pageable one is first staged through a driver buffer by the host itself.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several host arrays in one copy: packed into one pinned buffer, sent up at once, and
    returned as device views of their own dtype and shape. Each copy costs the device a few
    microseconds however small it is, and a step has a dozen inputs."""
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]
    packed, offsets = pack(arrays, pinned=True)
    return unpack(packed.to(device, non_blocking=True), arrays, offsets)


def pack(arrays: list[np.ndarray], pinned: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The arrays' bytes in one uint8 tensor, each at an 8-byte aligned offset."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8
    packed = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=pinned)
    staging = packed.numpy()
    for a, at in zip(arrays, offsets):
        staging[at:at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return packed, offsets


def unpack(packed: torch.Tensor, arrays: list[np.ndarray],
           offsets: list[int]) -> list[torch.Tensor]:
    """Views of `packed` (wherever it now is) with each array's dtype and shape."""
    return [packed[at:at + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, at in zip(arrays, offsets)]
