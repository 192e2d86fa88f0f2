"""How many KV blocks an engine's cache holds: its share of the GPU (or `kv_cache_memory_gb` on
the CPU) less what it already holds and a reserve for activations, capped at what
`max_num_seqs` full-length sequences can use; with tensor parallelism, the least any rank
can hold (each sizes its own)."""
from __future__ import annotations

import torch

from pd_cluster import distributed as dist
from pd_cluster.config import EngineConfig, ModelConfig

# GPU memory an engine holds outside torch's allocator (CUDA context, kernel images, library
# handles): counted against its gpu_memory_utilization share.
NON_TORCH_BYTES = 1 << 30


def num_blocks(config: EngineConfig, model_cfg: ModelConfig, num_kv_heads: int,
               kv_dtype: torch.dtype, device: torch.device, torch_base: int,
               max_model_len: int) -> int:
    """This rank's blocks. `num_kv_heads`: the rank's own; `torch_base`: what this process's
    allocator held before the engine loaded anything (another engine's, in tests)."""
    c, m = config, model_cfg
    if c.num_kv_blocks is not None:
        return c.num_kv_blocks
    # K and V, or one latent entry for MLA (a third or less of a GQA model's bytes).
    bytes_per_block = c.block_size * m.kv_bytes_per_token(kv_dtype.itemsize, num_kv_heads)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Leave room for activations of a full token budget (logits dominate at large vocab).
        reserve = c.max_num_batched_tokens * (8 * m.hidden_size + 2 * m.intermediate_size) * 4
        # Our share of the GPU less what we hold (vLLM's meaning): what our allocator took
        # since we started, plus the CUDA context and libraries' own memory. Not the
        # device's used memory: an engine starting beside us on the GPU would count as
        # ours, and whichever sized its KV second got next to nothing. Never more than free.
        mine = torch.cuda.memory_reserved(device) - torch_base + NON_TORCH_BYTES
        budget = min(total * c.gpu_memory_utilization - mine, free) - reserve
    else:
        budget = c.kv_cache_memory_gb * 2**30
    # No point in more blocks than max_num_seqs full-length sequences can use.
    cap = c.max_num_seqs * -(-max_model_len // c.block_size) + 1
    n = min(int(budget // bytes_per_block), cap)
    if n < 2:
        raise ValueError(f"not enough memory for the KV cache ({budget / 2**30:.2f} GiB left)")
    return n


def agreed(num_blocks: int, tp_size: int) -> int:
    """The KV blocks every rank can hold (they size theirs apart): the least of them. Every
    rank calls this at the same point of its start."""
    if tp_size == 1:
        return num_blocks
    import torch.distributed as tdist
    least = torch.tensor([num_blocks], dtype=torch.int64)
    tdist.all_reduce(least, op=tdist.ReduceOp.MIN, group=dist.get_tp().cpu_group)
    return int(least.item())
