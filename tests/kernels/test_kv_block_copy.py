"""KV block copies by one kernel (kernels/kv_block_copy.py) against the torch reference: a
cache [layers, 2, blocks, block_size, heads, head_dim] to another, blocks scattered both ways.
On a CPU under TRITON_INTERPRET=1 (both caches on the CPU); with a GPU, GPU cache <-> pinned,
registered host memory, as the KV tiers copy."""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import torch  # noqa: E402

from kernels.kv_block_copy import copy_blocks, copy_blocks_ref  # noqa: E402


def test_kernel_copies_the_listed_blocks_and_nothing_else():
    gen = torch.Generator().manual_seed(0)
    shape = (3, 2, 10, 4, 2, 8)             # 3 layers, K/V, 10 blocks of 4 tokens
    host = torch.randn(shape, generator=gen).to(torch.bfloat16)
    gpu = torch.zeros(shape, dtype=torch.bfloat16,
                      device="cpu" if INTERPRETED else "cuda")
    if not INTERPRETED:
        host = host.pin_memory()
    src_ids, dst_ids = [7, 2, 5], [0, 9, 4]
    want = gpu.clone()
    copy_blocks_ref(host, want, src_ids, dst_ids)
    copy_blocks(host, gpu, src_ids, dst_ids)          # host -> cache
    assert torch.equal(gpu.cpu(), want.cpu())
    back = torch.zeros_like(host)
    if not INTERPRETED:
        back = back.pin_memory()      # the kernel addresses host memory CUDA has mapped
    copy_blocks(gpu, back, dst_ids, src_ids)          # cache -> host
    if not INTERPRETED:
        torch.cuda.synchronize()
    assert torch.equal(back[:, :, src_ids], host[:, :, src_ids])
    assert not back[:, :, [0, 1, 3, 4, 6, 8, 9]].any()
