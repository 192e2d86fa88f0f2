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
current one's later waves need), so kernels do not. `PD_CLUSTER_PDL=0` in the environment
turns PDL off (for comparison).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

RELEASE_MAX_ROWS = 64


@functools.lru_cache(maxsize=None)
def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA GPU of compute capability 9.0 or
    later, unless PD_CLUSTER_PDL=0."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and os.environ.get("PD_CLUSTER_PDL", "1") != "0")


def release_max_rows() -> int:
    """Rows (tokens) up to which kernels release the next kernel at their start."""
    return int(os.environ.get("PD_CLUSTER_PDL_RELEASE_ROWS", RELEASE_MAX_ROWS))


def pdl_args(device: torch.device, rows: int | None = None) -> dict:
    """The launch keywords of a PDL kernel: its PDL and RELEASE constexprs and Triton's
    launch option. RELEASE for a kernel over at most `release_max_rows()` rows."""
    pdl = use_pdl(device)
    release = pdl and rows is not None and rows <= release_max_rows()
    return {"PDL": pdl, "RELEASE": release, "launch_pdl": pdl}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr, RELEASE: tl.constexpr = False):
    """The first statement of a PDL kernel (module docstring), after any `prefetch_l2` of
    what the kernel before does not write; nothing without PDL. RELEASE first lets the next
    kernel launch."""
    if PDL:
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding `ptrs` (any shape; no fault, no wait, no
    register written back). Only on a GPU (inline PTX): callers pass PDL-gated constexprs."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
