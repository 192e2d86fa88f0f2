"""Paged attention inputs for the kernels' and backends' tests: the Triton interpreter in fp32
on a CPU (its tl.dot is wrong on bf16), bf16 on a GPU. Import this module before any kernel
module: it decides whether Triton interprets (kernels/testing.py)."""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import torch  # noqa: E402

from pd_cluster.attention.base import AttentionMetadata  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPE = torch.float32 if INTERPRETED else torch.bfloat16


def build_batch(cached: list[int], new: list[int], block_size: int,
                num_blocks: int) -> AttentionMetadata:
    """Metadata for sequences with `cached` tokens already in the pool and `new` this step;
    each sequence gets shuffled blocks, and the new tokens' slots follow their cached ones."""
    seq_lens = [c + n for c, n in zip(cached, new)]
    order = torch.randperm(num_blocks).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables, slots = [], []
    for c, n in zip(cached, new):
        blocks, order = order[:width], order[width:]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    num_decodes = sum(1 for n in new if n == 1)  # callers put decodes first

    def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return AttentionMetadata(
        slot_mapping=as_tensor(slots, torch.int64),
        query_start_loc=as_tensor(starts, torch.int32), seq_lens=as_tensor(seq_lens, torch.int32),
        block_tables=as_tensor(tables, torch.int32), num_decodes=num_decodes,
        num_decode_tokens=num_decodes, max_query_len=max(new), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)


def paged_kv(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype = DTYPE, device: str = DEVICE):
    """Random K/V caches and a block table giving each sequence shuffled blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks that no sequence owns
    order = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, dtype=dtype, device=device) for _ in range(2))
    return k_cache, v_cache, table.to(device)
