"""The peer all-reduce kernels compile for Hopper (sm90) on a machine without a GPU, and their
data moves 16 bytes at a time. The CPU suite runs them under Triton's interpreter, which
accepts code the compiler refuses (a plain module global read inside a kernel, say), so a
kernel can pass every CPU test and still fail on the first GPU call.

The compile runs in a process without TRITON_INTERPRET (under it `triton.jit` gives
interpreted functions, which cannot be compiled); pointer and size arguments are declared
16-byte aligned, as Triton specializes them when the engine's tensors are.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow       # a process that imports torch and Triton, five compiles


COMPILE = r"""
import collections, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import peer_all_reduce as barrier, peer_push_all_reduce as push

FLAT = {"X": "*bf16", "Out": "*bf16", "n": "i32"}
SPIN = {"failed": "*i32", "rank": "i32", "max_spins": "i32"}
NORM = {"X": "*bf16", "Residual": "*bf16", "ResidualOut": "*bf16", "Weight": "*bf16",
        "Out": "*bf16", "Scale": "*bf16", "eps": "fp32", "rows": "i32"}
NORM_C = {"HIDDEN": 4096, "BLOCK": 4096, "ALIGN": 4096, "QUANT": False}
FLAT_C = {"BLOCK": barrier.BLOCK}
CASES = {
    "push": (push._push_kernel, {**FLAT, "slot_elems": "i32", "push_ptrs": "*i64",
                                 "counters": "*i64", **SPIN}, {**FLAT_C, "PDL": True}, 8),
    "push_rms_norm": (push._push_rms_norm_kernel, {**NORM, "slot_elems": "i32",
                      "push_ptrs": "*i64", "counters": "*i64", **SPIN},
                      {**NORM_C, "PDL": True}, 16),
    "one_shot": (barrier._one_shot_kernel, {**FLAT, "half_elems": "i32", "sig_ptrs": "*i64",
                 "data_ptrs": "*i64", "counters": "*i64", **SPIN}, FLAT_C, 8),
    "two_shot": (barrier._two_shot_kernel, {**FLAT, "half_elems": "i32", "sig_ptrs": "*i64",
                 "data_ptrs": "*i64", "red_ptrs": "*i64", "counters": "*i64", **SPIN},
                 FLAT_C, 8),
    "one_shot_rms_norm": (barrier._one_shot_rms_norm_kernel, {**NORM, "half_elems": "i32",
                          "sig_ptrs": "*i64", "norm_ptrs": "*i64", "counters": "*i64",
                          **SPIN}, NORM_C, 16),
}
out = {}
for name, (fn, sig, const, warps) in CASES.items():
    const = {**const, "WORLD": 2, "PROGRAMS": barrier.PROGRAMS}
    sig = {a: sig.get(a, "constexpr") for a in fn.arg_names}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
               for a, t in sig.items() if t.startswith("*") or a in ("n", "rows",
               "slot_elems", "half_elems")}
    src = ASTSource(fn, sig, constexprs=const, attrs=aligned)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps}).asm["ptx"]
    out[name] = dict(collections.Counter(re.findall(r"\b((?:ld|st)\.[\w.]*global[\w.]*)", ptx)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def memory_ops() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _vectors(ops: dict, kind: str) -> int:
    return sum(n for op, n in ops.items() if op.startswith(kind) and ".v4." in op)


@pytest.mark.parametrize("kernel", ["push", "push_rms_norm", "one_shot", "two_shot",
                                    "one_shot_rms_norm"])
def test_peer_kernel_compiles_for_sm90_with_16_byte_loads_and_stores(memory_ops, kernel):
    ops = memory_ops[kernel]
    assert _vectors(ops, "ld.") > 0 and _vectors(ops, "st.") > 0, ops


def test_push_kernels_poll_their_slots_with_volatile_loads(memory_ops):
    for kernel in ("push", "push_rms_norm"):
        assert any(op.startswith("ld.volatile.global.v4") for op in memory_ops[kernel]), \
            memory_ops[kernel]
