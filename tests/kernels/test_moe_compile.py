"""The fused MoE's Triton kernels (kernels/fused_moe_triton.py) compile for Hopper (sm90) on a
machine without a GPU, with every tile configuration the launcher picks at Qwen3-30B-A3B's
sizes: decode batches and prefill chunks, the whole layer on one GPU, 64 whole experts a GPU
(expert parallel over 2) and half of every expert (tensor parallel over 2), bf16 and FP8
experts. The CPU suite runs the kernels under Triton's interpreter, which accepts code the
compiler refuses (a plain module global read inside a kernel, say), so a kernel can pass
every CPU test and still fail on the first GPU call. kernels/moe_align.py's one-launch sort
too, for each layout's local expert count.

The compile runs in a process without TRITON_INTERPRET (under it `triton.jit` gives
interpreted functions, which cannot be compiled); pointers, and the sizes and strides the
real shapes make multiples of 16, are declared 16-byte divisible, as Triton specializes them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow       # a process that imports torch and Triton, 23 compiles


COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fused_moe_triton as moe, moe_align as align

H, E, K = 2048, 128, 8       # Qwen3-30B-A3B's MoE layer
# name -> (local experts, intermediate size per GPU)
LAYOUTS = {"whole": (E, 768), "ep2": (E // 2, 768), "tp2": (E, 384)}
# Decode batches (tp_bench's 64 and 128 among them) and prefill chunks up to its 16384 tokens.
TOKENS = (1, 8, 64, 128, 256, 512, 1024, 2048, 8192, 16384)
INTS = ("N", "K", "pairs", "stride_am", "stride_be", "stride_bn", "stride_cm", "stride_bse",
        "H", "stride_out", "first_expert", "num_experts")
DIVISIBLE = ("N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm", "stride_bse", "H",
             "stride_out")


def compile(fn, types, const, warps, stages=None):
    sig = {a: types.get(a, "i32" if a in INTS else "constexpr") for a in fn.arg_names}
    const = {a: v for a, v in {**const, "PDL": True}.items() if a in fn.arg_names}
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
               for a, t in sig.items() if t.startswith("*") or a in DIVISIBLE}
    options = {"num_warps": warps, **({"num_stages": stages} if stages else {})}
    kernel = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {"mma": sorted(set(re.findall(r"\b(w?gmma\.\w+|mma\.sync)", ptx))),
            "shared": kernel.metadata.shared}


# Each distinct launch: (dtype, GEMM, tiles) -> the sizes that pick it.
launches = {}
for fp8 in (False, True):
    for layout, (experts, inter) in LAYOUTS.items():
        for tokens in TOKENS:
            for gemm, n, k in (("up", 2 * inter, H), ("down", H, inter)):
                cfg = moe.tiles(tokens * K, experts, n, k, fp8)
                launches.setdefault((fp8, gemm, cfg), []).append(f"{layout}_T{tokens}")
out = {}
for (fp8, gemm, cfg), used in launches.items():
    elem, scale = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    types = {"A": elem, "B": elem, "C": "*bf16", "SortedIds": "*i32", "ExpertIds": "*i32",
             "AScale": scale, "BScale": scale}
    const = {"PAIRS_PER_ROW": K if gemm == "up" else 1, "SCALED": fp8,
             "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    name = (f"{'fp8' if fp8 else 'bf16'}_{gemm}_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}"
            f"_s{cfg.num_stages}")
    out[name] = {**compile(moe._moe_gemm_kernel, types, const, cfg.num_warps, cfg.num_stages),
                 "block_m": cfg.block_m, "used_by": used}
# The model's router weights are in the model dtype, moe_bench's in float32.
for weights in ("bf16", "fp32"):
    out[f"sum_{weights}"] = compile(
        moe._moe_sum_kernel, {"Y": "*bf16", "TopkIds": "*i64", "TopkWeights": f"*{weights}",
                              "Out": "*bf16"}, {"TOP_K": K, "K_POW2": K, "BLOCK_H": moe.SUM_BLOCK},
        4)
# The one-launch sort of a decode batch's pairs, at each layout's local expert count (and
# DeepSeek-V3's 256, which takes the same kernel).
for experts in sorted({experts for experts, _ in LAYOUTS.values()} | {256}):
    for block_m in (16, 32, 64):
        out[f"align_e{experts}_m{block_m}"] = compile(
            align._align_kernel, {"TopkIds": "*i64", "SortedIds": "*i32", "ExpertIds": "*i32",
                                  "NumPadded": "*i32", "pairs": "i32", "num_blocks": "i32",
                                  "size": "i32"},
            {"BLOCK_M": block_m, "BINS": triton.next_power_of_2(experts + 1),
             "CHUNK": align.CHUNK}, 4)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_launch_at_qwen3_30b_a3b_sizes_compiles_within_shared_memory(compiled):
    gemms = {name: info for name, info in compiled.items()
             if not name.startswith(("sum", "align"))}
    # Both GEMMs in both dtypes, at each of the three row tiles (decode to prefill).
    assert {info["block_m"] for info in gemms.values()} == {16, 32, 64}
    assert len(gemms) == 12, sorted(gemms)
    assert len(compiled) == len(gemms) + 2 + 9     # sums (two dtypes), sorts (E 64, 128, 256)
    for name, info in compiled.items():
        assert info["shared"] <= 232448, (name, info)       # a Hopper SM's 227 KB


def test_gemms_multiply_on_the_tensor_cores_wgmma_for_64_row_tiles(compiled):
    for name, info in compiled.items():
        if name.startswith(("sum", "align")):
            continue
        assert info["mma"], (name, info)
        if info["block_m"] == 64:
            assert any(op.startswith("wgmma") for op in info["mma"]), (name, info)
