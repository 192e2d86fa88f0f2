"""TritonAttentionBackend gives TorchAttentionBackend's results (RoPE, KV store, attention)
on decode-first mixed batches.

CPU: TRITON_INTERPRET=1 in fp32, tiny shapes. GPU: bf16 (atol = rtol = 2e-2, as in
test_kernels_attention.py).
"""
from tests.support.attention import DEVICE, DTYPE, INTERPRETED, build_batch

import pytest  # noqa: E402
import torch  # noqa: E402

from pd_cluster.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pd_cluster.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pd_cluster.models.layers import RotaryEmbedding  # noqa: E402

TOL = 1e-4 if INTERPRETED else 2e-2


@pytest.mark.slow
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
