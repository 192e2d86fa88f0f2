"""Small host values onto the device without waiting for the device's queued work."""
from __future__ import annotations

import numpy as np
import torch


def upload(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`; on a GPU the copy is queued behind the stream's work.

    The host side is pinned (from PyTorch's caching host allocator, which keeps the block
    until the copy has run): a copy from pinned memory is one DMA that the host only queues,
    where a pageable one is first staged through a driver buffer by the host itself.
    """
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
