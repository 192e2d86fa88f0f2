"""Everything one forward pass needs besides the token ids, passed explicitly to every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pd_cluster.attention.base import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    # [num_layers, parts (2: K and V; 1: a latent cache), num_blocks, block_size, kv_heads,
    # head_dim] (pd_cluster/kv_layout.py)
    kv_cache: torch.Tensor
    backend: AttentionBackend
    # Called after each layer has written its KV: the prefill side starts that layer's transfer
    # here, so sending layer i overlaps computing layer i + 1.
    on_layer_done: Callable[[int], None] | None = None
