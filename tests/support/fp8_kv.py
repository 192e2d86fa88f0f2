"""FP8 KV caches and their scales for the attention kernels' tests (the Triton interpreter on a
CPU, bf16 on a GPU). Import this module before any kernel module: it decides whether Triton
interprets (kernels/testing.py)."""
import torch  # noqa: E402

from kernels.fp8_math import quantize  # noqa: E402
from tests.support.attention import DEVICE, DTYPE, INTERPRETED
from tests.support.attention import paged_kv as random_paged_kv

__all__ = ["ATTN_TOL", "DEVICE", "DTYPE", "INTERPRETED", "KV_SCALE", "K_SCALE", "V_SCALE",
           "fp8_caches"]
# The attention kernels round each tile's probabilities to float16 for the P x V dot (the
# reference keeps them in fp32): relative error up to 2^-11 of each weight.
ATTN_TOL = 1e-3 if INTERPRETED else 2e-2
K_SCALE, V_SCALE = 0.03125, 0.015625     # unit-variance values reach 448 at 14 and 7
KV_SCALE = torch.tensor([K_SCALE, V_SCALE], dtype=torch.float32, device=DEVICE)


def fp8_caches(seq_lens, bs, kv_heads, head_dim):
    """Unit-variance K and V caches (model dtype) and their fp8 versions, and a block table."""
    k, v, table = random_paged_kv(seq_lens, bs, kv_heads, head_dim, torch.float32, DEVICE)
    return (k.to(DTYPE), v.to(DTYPE)), (quantize(k, K_SCALE), quantize(v, V_SCALE)), table
