"""MLA decode attention (kernels/mla_decode.py) against its fp32 torch reference (issue 45).

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU in fp32 (the interpreter's
tl.dot is wrong on bf16) on small latent and RoPE widths, plus one case at DeepSeek's own
(L 512, R 64); with a GPU, the same cases in bf16. bf16 tolerance: P is rounded to bf16 for
the P @ c product and the output is bf16 (tests/kernels/test_attention.py). The slow test
compiles the kernels for sm90 in bf16 without a GPU (tests/kernels/test_peer_kernels_compile.py says
why the interpreter alone is not enough).
"""
from tests.support import REPO
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.mla_decode import mla_decode, mla_decode_ref  # noqa: E402
from kernels.mla_rope_store import mla_rope_store  # noqa: E402
from kernels.reference import mla_rope_store_ref  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPE = torch.float32 if INTERPRETED else torch.bfloat16
TOL = 1e-4 if INTERPRETED else 2e-2
# Two lengths of 1 (a chunk of one position), lengths inside one block, on a block boundary
# and across several; with block sizes 16 (the engine's default, pd_cluster/config.py) and 64.
SEQ_LENS = [1, 37, 100, 64]


def paged_latent_cache(seq_lens: list[int], block_size: int, width: int, pad: int = 0):
    """A random cache [num_blocks, block_size, width] whose rows lie width + pad apart, and a
    block table giving each sequence shuffled blocks (two spare blocks no sequence owns)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = order[taken:taken + n]
        taken += n
    rows = torch.randn(num_blocks, block_size, width + pad, dtype=DTYPE, device=DEVICE)
    return rows[..., :width], table.to(DEVICE)


def check_mla(seq_lens: list[int], block_size: int, num_heads: int, latent: int, rope: int,
              pad: int = 0, **knobs) -> None:
    kv_cache, table = paged_latent_cache(seq_lens, block_size, latent + rope, pad)
    q_latent = torch.randn(len(seq_lens), num_heads, latent, dtype=DTYPE, device=DEVICE)
    q_pe = torch.randn(len(seq_lens), num_heads, rope, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = (latent + rope) ** -0.5
    out = mla_decode(q_latent, q_pe, kv_cache, table, lens, scale, max(seq_lens), **knobs)
    ref = mla_decode_ref(q_latent, q_pe, kv_cache, table, lens, scale)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 3])     # stage 1 writes `out` / stage 2 merges
@pytest.mark.parametrize("num_heads", [16, 32])    # one and two head blocks
@pytest.mark.parametrize("block_size", [16, 64])
def test_mla_decode_matches_reference(block_size, num_heads, num_splits):
    check_mla(SEQ_LENS, block_size, num_heads, latent=64, rope=16, num_splits=num_splits)


@pytest.mark.slow
@pytest.mark.parametrize("seq_lens,block_size,num_heads,knobs", [
    ([1], 16, 16, dict(num_splits=4)),                   # one position, trailing splits empty
    ([70, 5], 16, 24, dict(block_n=64, num_splits=2)),   # half a head block; tile = 4 blocks
    ([100, 33, 17], 64, 32, dict(block_h=32, block_n=32, num_splits=2)),  # tile < block
    ([300, 90], 16, 16, {}),                             # the launcher picks the splits
])
def test_mla_decode_shapes_and_knobs(seq_lens, block_size, num_heads, knobs):
    check_mla(seq_lens, block_size, num_heads, latent=64, rope=16, **knobs)


def test_mla_decode_at_deepseek_widths_with_padded_rows():
    # L 512 and R 64 as DeepSeek-V2/V3; the cache rows 640 values apart (a view of a wider
    # buffer), a width no power of two would give.
    check_mla([1, 45], 16, 16, latent=512, rope=64, pad=64, num_splits=2)


def test_mla_decode_odd_widths():
    # Neither width a power of two: the padded dims are masked.
    check_mla([20, 50], 16, 16, latent=40, rope=10, num_splits=2)


@pytest.mark.parametrize("slope", [1.0, -0.5])
def test_mla_decode_follows_a_max_that_moves_along_the_context(slope):
    # Scores that climb by more than the lazy-rescale threshold within a tile (slope > 0), or
    # fall so that the first tile's max stands to the end (slope < 0).
    seq_lens, block_size, latent, rope = [100, 61], 16, 32, 16
    kv_cache, table = paged_latent_cache(seq_lens, block_size, latent + rope)
    q_latent = torch.zeros(len(seq_lens), 16, latent, dtype=DTYPE, device=DEVICE)
    q_pe = torch.zeros(len(seq_lens), 16, rope, dtype=DTYPE, device=DEVICE)
    q_pe[..., 0] = 8.0
    for i, n in enumerate(seq_lens):
        for pos in range(n):
            kv_cache[table[i, pos // block_size], pos % block_size, latent] = slope * pos
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 2):
        out = mla_decode(q_latent, q_pe, kv_cache, table, lens, 0.125, num_splits=num_splits,
                         block_n=16)
        ref = mla_decode_ref(q_latent, q_pe, kv_cache, table, lens, 0.125)
        torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)


def test_mla_decode_empty_batch_launches_nothing():
    kv_cache, table = paged_latent_cache([5], 16, 80)
    q = torch.empty(0, 16, 64, dtype=DTYPE, device=DEVICE)
    out = mla_decode(q, q[..., :16], kv_cache, table[:0],
                     torch.empty(0, dtype=torch.int32, device=DEVICE), 0.1)
    assert out.shape == (0, 16, 64)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_store_equals_the_unfused_ops_and_skips_negative_slots(interleave):
    # Odd latent width (masked), 3 heads (a padded head block), a cache whose rows are padded
    # apart, and a CUDA graph's padding rows (slot -1), which must leave the cache alone.
    heads, nope, latent, rope, block_size, t = 3, 8, 40, 16, 16, 5
    cache, _ = paged_latent_cache([64], block_size, latent + rope, pad=6)
    cache.zero_()
    q = torch.randn(t, heads, nope + rope, dtype=DTYPE, device=DEVICE)
    kv = torch.randn(t, latent + rope, dtype=DTYPE, device=DEVICE) * 3
    weight = torch.randn(latent, dtype=DTYPE, device=DEVICE)
    positions = torch.tensor([0, 7, 3, 100, 2], device=DEVICE)
    angles = torch.outer(torch.arange(128.0), torch.rand(rope // 2) * 0.5).to(DEVICE)
    slots = torch.tensor([17, 3, -1, 40, -1], device=DEVICE)
    want_q, want_cache = q.clone(), cache.clone()
    mla_rope_store_ref(want_q, kv, weight, 1e-6, positions, angles.cos(), angles.sin(),
                       interleave, want_cache, slots)
    mla_rope_store(q, kv, weight, 1e-6, positions, angles.cos(), angles.sin(), interleave,
                   cache, slots)
    torch.testing.assert_close(q, want_q, atol=TOL, rtol=TOL)
    torch.testing.assert_close(cache, want_cache, atol=TOL, rtol=TOL)
    assert torch.equal(q[..., :nope], want_q[..., :nope])      # q_nope untouched
    written = {17, 3, 40}
    for s in range(64):
        if s not in written:
            assert not cache[s // block_size, s % block_size].any()


# The launcher's own constexprs at DeepSeek's widths and the engine's block size, bf16, PDL on
# (sm90), at 16 query heads (V2-Lite; V3 at TP 8) and 128 (V3 on one GPU); pointers and the
# strides that the launcher specializes declared 16-byte aligned.
COMPILE = r"""
import json, re, subprocess, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import decode_attention, mla_decode as mla, mla_rope_store

latent, rope, page = 512, 64, 16
ints = {"qk_scale": "fp32"}


def compile_kernel(fn, const, options, fp32=()):
    # pointers bf16 but the int32 tables and the `fp32` scratch
    sig = {a: ("*bf16" if a[0].isupper() else ints.get(a, "i32")) for a in fn.arg_names}
    sig.update({a: "*i32" for a in ("BlockTables", "SeqLens") if a in sig})
    sig.update({a: "*i64" for a in ("Positions", "Slots") if a in sig})
    sig.update({a: "*fp32" for a in fp32})
    sig.update({a: "constexpr" for a in const})
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") and a not in ("BlockTables", "SeqLens", "Positions", "Slots")}
    src = ASTSource(fn, sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def usage(kernel):
    # registers and stack (spills) a thread, as the cubin records them
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", text).groups()
    return {"shared": kernel.metadata.shared, "registers": int(regs), "stack": int(stack)}


out = {}
for num_heads in (16, 128):
    meta = mla.stage1_meta(num_heads, latent, rope, page, torch.device("cpu"))
    meta.update(PDL=True)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages", "launch_pdl")}
    for direct in (True, False):
        scratch = ("PartialLse",) if direct else ("PartialOut", "PartialLse")
        kernel = compile_kernel(mla._mla_stage1_kernel, {**meta, "DIRECT": direct}, options,
                                scratch)
        out[f"h{num_heads}_stage1_direct_{direct}"] = usage(kernel)
stage2 = decode_attention._decode_stage2_kernel
kernel = compile_kernel(stage2, {"HEAD_DIM": latent, "BLOCK_D": meta["BLOCK_L"],
                                 "BLOCK_N": meta["BLOCK_N"], "OUT_FP8": False, "PDL": True},
                        {"num_warps": 4, "launch_pdl": True}, ("PartialOut", "PartialLse"))
out["stage2"] = usage(kernel)
fn = mla_rope_store._mla_rope_store_kernel
ints.update({"eps": "fp32"})
const = {"NUM_HEADS": 16, "NOPE": 128, "LATENT": latent, "HALF": rope // 2, "PAGE_SIZE": page,
         "BLOCK_H": 16, "BLOCK_L": latent, "INTERLEAVE": True, "PDL": True}
kernel = compile_kernel(fn, const, {"num_warps": 4, "launch_pdl": True}, ("Cos", "Sin"))
out["rope_store"] = usage(kernel)
print(json.dumps(out))
"""


@pytest.mark.slow       # a process that imports torch and Triton, five compiles
def test_mla_kernels_compile_for_sm90_in_bf16():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(kernels) == {f"h{h}_stage1_direct_{d}" for h in (16, 128)
                            for d in (True, False)} | {"stage2", "rope_store"}, kernels
    # No spills (kernels/mla_decode.py's launch defaults say what spills), and shared memory for two
    # programs an SM (228 KiB on an H100/H200): the loads of one hide the other's math.
    assert all(k["stack"] == 0 for k in kernels.values()), kernels
    assert all(k["shared"] <= 110 * 1024 for k in kernels.values()), kernels
