"""Programmatic dependent launch (PDL, sm90+): a kernel launched with it is staged while the
kernel before it drains, so part of its launch overlaps the other's tail.

Every kernel that takes part calls `wait_for_inputs` before it touches memory:
griddepcontrol.wait returns once the kernel before it has finished and its writes are
visible, so reads of its outputs, and writes to buffers it still reads, are safe. Kernels
launched without PDL (cuBLAS, torch) keep plain stream order.

Measured in the engine's CUDA graphs on an H200 (FP8 8B shape, context 1k, decode step, PDL
off then on, twice each; bench/engine_bench.py): batch 64 4.87 / 4.95 -> 4.83 / 4.89 ms,
batch 256 11.30 / 11.34 -> 11.21 / 11.28 ms. Letting each kernel release the next at its
start as well (griddepcontrol.launch_dependents) gained more at batch 64 (4.88 -> 4.76 ms)
but lost at 256 (11.25 -> 11.35 ms: the next kernel's waiting programs hold SM slots the
current one's later waves need), so kernels do not. Nor does releasing at batch <= 256 pay
on today's kernels, with or without GEMMs and decode attention asking L2 for their weights
and first KV tiles while they wait (H200, batch 64 / 128 / 256: 4.73 / 6.46 / 10.41 ms a
step -> 4.88 / 6.82 / 10.60 releasing, 4.86 / 7.04 / 10.97 prefetching too;
bench/results/pdl_release_prefetch_h200_*.json). `PD_CLUSTER_PDL=0` in the environment turns
PDL off (for comparison).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA GPU of compute capability 9.0 or
    later, unless PD_CLUSTER_PDL=0."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and os.environ.get("PD_CLUSTER_PDL", "1") != "0")


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a PDL kernel: its PDL constexpr and Triton's launch option."""
    pdl = use_pdl(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """The first statement of a PDL kernel (module docstring); nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
