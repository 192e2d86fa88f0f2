"""Programmatic dependent launch (PDL, sm90+): a kernel launched with it may start while the
kernel before it drains, so its launch and set-up overlap the other's tail.

A decode step is a few hundred short kernels, many of them a few microseconds long; at batch
64 on an H100 a CUDA graph of 32 layers of them ran 2.6 % faster with PDL
(bench/results/pdl_chain_h100x1_b64.json). Every kernel that takes part calls
`wait_for_inputs` before it touches memory: griddepcontrol.wait returns once the kernel
before it has finished and its writes are visible, so reads of its outputs, and writes to
buffers it still reads, are safe. It first lets the next kernel launch
(griddepcontrol.launch_dependents), whose programs then wait in their own
`wait_for_inputs`. Kernels launched without PDL (cuBLAS, torch) keep stream order.

`PD_CLUSTER_PDL=0` in the environment turns it off (for comparison).
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
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
