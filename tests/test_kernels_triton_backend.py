"""TritonAttentionBackend gives TorchAttentionBackend's results (RoPE, KV store, attention)
on decode-first mixed batches.

CPU: TRITON_INTERPRET=1 in fp32, tiny shapes. GPU: bf16 (atol = rtol = 2e-2, as in
test_kernels_attention.py).
"""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from pd_cluster.attention.base import AttentionMetadata  # noqa: E402
from pd_cluster.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pd_cluster.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pd_cluster.models.layers import RotaryEmbedding  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPE = torch.float32 if INTERPRETED else torch.bfloat16
TOL = 1e-4 if INTERPRETED else 2e-2


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


@pytest.mark.parametrize("cached,new", [
    ([40, 7, 100, 0, 33], [1, 1, 1, 21, 9]),  # decodes, then a fresh prompt and a chunk
    ([5, 63], [1, 1]),                          # decodes only
    ([0, 48], [30, 17]),                        # prefills only, one after a cached prefix
])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_triton_backend_matches_torch_backend(cached, new, head_dim, block_size):
    num_heads, num_kv_heads, num_blocks = 4, 2, 40
    meta = build_batch(cached, new, block_size, num_blocks)
    tokens = sum(new)
    q = torch.randn(tokens, num_heads, head_dim, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(tokens, num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
            for _ in range(2))
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, dtype=DTYPE, device=DEVICE) for _ in range(2))
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    scale = head_dim ** -0.5
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None).to(DEVICE)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(DEVICE)
    ref = TorchAttentionBackend().forward(q.clone(), k, v, positions, rope, ref_k_cache,
                                          ref_v_cache, meta, scale)
    out = TritonAttentionBackend().forward(q, k, v, positions, rope, k_cache, v_cache, meta,
                                           scale)
    # The torch backend rotates in the model dtype (as HF does), the kernel in fp32.
    torch.testing.assert_close(k_cache, ref_k_cache, atol=TOL, rtol=TOL)
    assert torch.equal(v_cache, ref_v_cache)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
