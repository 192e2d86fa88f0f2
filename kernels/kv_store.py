"""Write the K and V of new tokens into the paged KV cache.

    k, v          [T, num_kv_heads, head_dim]
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping  [T] int: token t goes to block slot // block_size, offset slot % block_size;
                  a negative slot (padding) is skipped
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    K, V, KCache, VCache, SlotMapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copies its [num_kv_heads, head_dim] K and V rows."""
    token = tl.program_id(0)
    slot = tl.load(SlotMapping + token).to(tl.int64)
    if slot < 0:
        return
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_HEADS)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(K + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(V + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    k_dst = KCache + block * stride_kcb + offset * stride_kcs + offs_h * stride_kch + offs_d
    v_dst = VCache + block * stride_vcb + offset * stride_vcs + offs_h * stride_vch + offs_d
    tl.store(k_dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VCache.dtype.element_ty), mask=mask)


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k/v into k_cache/v_cache in place (shapes in the module docstring)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # The kernel indexes head_dim with unit stride; the caches' strides are passed explicitly.
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    _kv_store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
