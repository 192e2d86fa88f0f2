"""Real KV blocks for the transfer and KV cache tests: a tiny random Llama's K/V, scattered
into a paged KV cache.

Until the engine exposes `engine.kv_cache`, the KV comes from HF transformers running a tiny
random `LlamaForCausalLM` over a prompt; `paged_kv` lays it out exactly as the engine does
([layers, 2, blocks, block_size, kv_heads, head_dim]), so only `model_kv` changes later.
"""
from __future__ import annotations

import torch

from pd_cluster.kv_layout import KVLayout


def tiny_layout(num_blocks: int = 32, **overrides) -> KVLayout:
    fields = dict(model="tiny-llama", dtype="bfloat16", num_layers=2, num_blocks=num_blocks,
                  block_size=4, num_kv_heads=2, head_dim=16)
    return KVLayout(**{**fields, **overrides})


def model_kv(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """K/V of a tiny random Llama over a random prompt: [layers, 2, tokens, kv_heads, head_dim]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=layout.num_kv_heads * layout.head_dim * 2,
                         intermediate_size=64, num_hidden_layers=layout.num_layers,
                         num_attention_heads=layout.num_kv_heads * 2,
                         num_key_value_heads=layout.num_kv_heads, head_dim=layout.head_dim)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, num_tokens))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    per_layer = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    # [layers, 2, kv_heads, tokens, head_dim] → [layers, 2, tokens, kv_heads, head_dim]
    return torch.stack(per_layer).transpose(2, 3).to(layout.torch_dtype).contiguous()


def paged_kv(layout: KVLayout, kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """A fresh KV cache holding `kv`'s tokens in `block_ids` (last block zero-padded)."""
    cache = layout.allocate()
    bs = layout.block_size
    for i, b in enumerate(block_ids):
        chunk = kv[:, :, i * bs:(i + 1) * bs]
        cache[:, :, b, :chunk.shape[2]] = chunk
    return cache


def blocks(cache: torch.Tensor, block_ids: list[int], layers: range | None = None) -> torch.Tensor:
    """The given blocks (all layers, or `layers`) as one tensor, for byte-exact comparisons."""
    sel = cache[:, :, block_ids]
    return sel if layers is None else sel[layers.start:layers.stop]


class FreeList:
    """The simulated engine side's free blocks (the engine's BlockAllocator is not needed here)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError(f"{n} blocks wanted, {len(self.free_ids)} free")
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return taken

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)
