"""The fused MoE (kernels/fused_moe_triton.py) against kernels/fused_moe.py's reference, and its
sort (kernels/moe_align.py) against a brute-force one (their compile for Hopper:
tests/kernels/test_moe_compile.py).

CPU: the Triton kernels under TRITON_INTERPRET=1 in fp32 (the interpreter's tl.dot is wrong
on bf16, and it truncates where the GPU rounds), where every step is the reference's up to
float32 rounding: 1e-5 relative. A GPU run in bf16 would differ by the GEMMs' order of
accumulation (the kernel module's docstring); none is here.

The silu of the gate/up rows of pairs routed to other ranks' experts reads memory never
written (the launcher leaves those rows alone, and nothing reads their result): numpy's
warnings about it are filtered.
"""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.fused_moe import fused_moe_ref  # noqa: E402
from kernels.fused_moe_triton import Tiles, fused_moe, moe_sum, tiles  # noqa: E402
from kernels.moe_align import (ONE_LAUNCH_MAX_PAIRS, align, moe_align,  # noqa: E402
                               moe_align_one_launch, padded_size)
from pd_cluster.models.fp8 import quantize_weight  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
DEVICE = "cpu" if INTERPRETED else "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- moe_align --------------------------------------------------------------------------------

def align_brute_force(ids: list[list[int]], experts: int, first: int, block_m: int):
    """(sorted_ids, expert_ids, num_padded) by the definition: each local expert's pairs in
    ascending order, padded to block_m with the sentinel, then padding to `size` rows."""
    flat = [e for row in ids for e in row]
    sentinel = len(flat)
    rows, blocks = [], []
    for e in range(experts):
        run = [p for p, g in enumerate(flat) if g - first == e]
        if run:
            run += [sentinel] * (-len(run) % block_m)
            rows += run
            blocks += [e] * (len(run) // block_m)
    num_padded = len(rows)
    size = padded_size(len(flat), experts, block_m)
    return rows + [sentinel] * (size - num_padded), blocks + [-1] * (size // block_m -
                                                                     len(blocks)), num_padded


@pytest.mark.slow
@pytest.mark.parametrize("fn,cases", [(moe_align, 300), (moe_align_one_launch, 30)])
def test_moe_align_matches_brute_force(fn, cases):
    """Random routings: E 1..8 local experts at a random offset in a larger global range (so
    that some choices fall outside it), K 1..4, T 1..40, several block sizes and id dtypes;
    torch's ops and the one-launch kernel alike."""
    rng = random.Random(0)
    for case in range(cases):
        experts, top_k, tokens = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 40)
        first = rng.randint(0, 3)
        global_experts = max(top_k, first + experts + rng.randint(0, 3))
        block_m = rng.choice([1, 2, 4, 16])
        ids = [rng.sample(range(global_experts), top_k) for _ in range(tokens)]
        dtype = torch.int32 if case % 2 else torch.int64
        got = fn(torch.tensor(ids, dtype=dtype, device=DEVICE), experts, first, block_m)
        want_rows, want_blocks, want_padded = align_brute_force(ids, experts, first, block_m)
        sorted_ids, expert_ids, num_padded = got
        assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
        assert sorted_ids.tolist() == want_rows, (case, ids)
        assert expert_ids.tolist() == want_blocks, (case, ids)
        assert num_padded.tolist() == [want_padded]


@pytest.mark.parametrize("fn", [moe_align, moe_align_one_launch])
def test_moe_align_shapes_depend_on_sizes_alone(fn):
    """A CUDA graph replays one shape: a routing onto one expert and one spread over all of
    them (the worst case) give the same buffer sizes, and the worst case fills them."""
    tokens, top_k, experts, block_m = 5, 2, 8, 4
    spread = (torch.arange(tokens * top_k).view(tokens, top_k) % experts).to(DEVICE)
    one = torch.zeros(tokens, top_k, dtype=torch.long, device=DEVICE)
    one[:, 1] = 1
    shapes = {tuple(t.shape for t in fn(ids, experts, 0, block_m)) for ids in (spread, one)}
    assert len(shapes) == 1
    # 10 pairs on 8 experts: 8 runs of one block, 2 of them with a second pair.
    assert fn(spread, experts, 0, block_m)[2].item() == 8 * block_m


@pytest.mark.slow      # under the interpreter, a program per expert runs one after another
@pytest.mark.parametrize("experts,first,global_experts", [(128, 0, 128), (60, 3, 70)])
def test_one_launch_align_gives_torchs_at_decode_sizes(experts, first, global_experts):
    """Qwen3-30B-A3B's routing (top-8 of 128), and an expert count no power of two on a rank
    whose experts start at 3: `align` takes the one-launch kernel for these (up to
    ONE_LAUNCH_MAX_PAIRS pairs), here over several of its chunks of pairs and of blocks."""
    assert 128 * 8 <= ONE_LAUNCH_MAX_PAIRS
    gen = torch.Generator().manual_seed(experts)
    for tokens, block_m in ((9, 64), (128, 16)):
        ids = torch.stack([torch.randperm(global_experts, generator=gen)[:8]
                           for _ in range(tokens)]).to(DEVICE)
        want = moe_align(ids, experts, first, block_m)
        for g, w in zip(align(ids, experts, first, block_m), want):
            assert torch.equal(g, w), (tokens, block_m)


# -- fused_moe against the reference ----------------------------------------------------------

def moe_inputs(tokens: int, experts: int, top_k: int, first: int, global_experts: int,
               hidden: int = 96, inter: int = 40, seed: int = 0):
    """x, w13, w2 of `experts` local experts, and each token's top_k distinct experts among
    `global_experts` (the local ones are first .. first + experts - 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    ids = torch.stack([torch.randperm(global_experts, generator=gen)[:top_k]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


# (T, local experts, K, first expert, global experts): T = 1 and T below the experts' count,
# top-1 and top-2 (and K = 3, not a power of two), whole-model experts and expert-parallel
# slices with choices outside them; T = 40 on 2 experts takes the 64-row tiles.
CASES = [(1, 4, 1, 0, 4), (1, 8, 2, 0, 8), (3, 8, 2, 0, 8), (6, 4, 2, 2, 8), (17, 3, 2, 4, 8),
         (9, 5, 3, 1, 7), (40, 2, 2, 0, 2), (25, 8, 1, 0, 8)]


@pytest.mark.parametrize("tokens,experts,top_k,first,global_experts", CASES)
def test_fused_moe_matches_reference(tokens, experts, top_k, first, global_experts):
    x, w13, w2, weights, ids = moe_inputs(tokens, experts, top_k, first, global_experts)
    out = fused_moe(x, w13, w2, weights, ids, first)
    ref = fused_moe_ref(x, w13, w2, weights, ids, first)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, ref) < 1e-5
    # A token none of whose experts is local gets exactly zero, as in the reference.
    none_local = ((ids < first) | (ids >= first + experts)).all(dim=1)
    assert not out[none_local].any()


def test_fused_moe_with_torchs_sort_past_the_one_launch_size(monkeypatch):
    """Past ONE_LAUNCH_MAX_PAIRS (here 0) the pairs are sorted by torch's ops: the same
    result."""
    import kernels.moe_align

    x, w13, w2, weights, ids = moe_inputs(17, 3, 2, 4, 8)
    monkeypatch.setattr(kernels.moe_align, "ONE_LAUNCH_MAX_PAIRS", 0)
    assert rel(fused_moe(x, w13, w2, weights, ids, 4),
               fused_moe_ref(x, w13, w2, weights, ids, 4)) < 1e-5


def test_fused_moe_with_tiles_that_loop_over_k_and_n():
    """Tiles narrower than H and I: several programs across N, several steps across K, and
    ragged last ones (H 96, 2I 80, I 40 against 32-wide tiles)."""
    x, w13, w2, weights, ids = moe_inputs(11, 6, 2, 1, 8, seed=1)
    narrow = Tiles(block_m=16, block_n=32, block_k=32)
    out = fused_moe(x, w13, w2, weights, ids, 1, config=(narrow, narrow))
    assert rel(out, fused_moe_ref(x, w13, w2, weights, ids, 1)) < 1e-5


def test_fused_moe_with_no_local_choice_and_no_tokens():
    x, w13, w2, weights, ids = moe_inputs(5, 2, 2, 0, 4, seed=2)
    # Every choice is one of experts 0..3, none of 10 and 11.
    assert not fused_moe(x, w13, w2, weights, ids, first_expert=10).any()
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, x.shape[1])


def test_sum_adds_each_tokens_slots_in_ascending_expert_order_rounding_as_torch():
    """The last step alone, bit for bit in fp16 (which the interpreter rounds as the GPU
    does): each weighted product rounded to fp16, added to the token's sum in ascending
    expert order, each partial sum rounded, as the reference's index_add_ loop; slots of
    experts outside the local range 2..5 left out."""
    gen = torch.Generator().manual_seed(3)
    tokens, top_k, hidden, first, experts = 9, 4, 40, 2, 4
    ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])
    ids[1] = torch.tensor([0, 1, 6, 7])         # none local
    y = (torch.randn(tokens * top_k, hidden, generator=gen) * 30).half()
    weights = torch.rand(tokens, top_k, generator=gen)
    out = torch.empty(tokens, hidden, dtype=torch.float16, device=DEVICE)
    moe_sum(y.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), first, experts, out)
    ref = torch.zeros(tokens, hidden, dtype=torch.float16)
    local, products = ids - first, y.view(tokens, top_k, hidden) * weights.half()[..., None]
    for e in range(experts):
        token, slot = torch.where(local == e)
        ref.index_add_(0, token, products[token, slot])
    assert torch.equal(out.cpu(), ref)
    # Slot order instead would round differently somewhere: the test can tell.
    slot_order = torch.zeros_like(ref)
    for k in range(top_k):
        keep = ((local[:, k] >= 0) & (local[:, k] < experts))[:, None]
        slot_order += torch.where(keep, products[:, k], 0)
    assert not torch.equal(slot_order, ref)


@pytest.mark.parametrize("tokens,experts,top_k,first,global_experts",
                         [(1, 4, 2, 0, 4), (13, 4, 2, 2, 8)])
def test_fp8_fused_moe_matches_fp8_reference(tokens, experts, top_k, first, global_experts):
    """Weights quantized per output channel as the FP8 layers' (pd_cluster/models/fp8.py);
    the kernels quantize x and h per token as the reference does."""
    x, w13, w2, weights, ids = moe_inputs(tokens, experts, top_k, first, global_experts)
    w13_q, w13_scale = quantize_weight(w13.flatten(0, 1))
    w2_q, w2_scale = quantize_weight(w2.flatten(0, 1))
    fp8 = (w13_q.view(w13.shape), w2_q.view(w2.shape), weights, ids, first,
           w13_scale.view(experts, -1), w2_scale.view(experts, -1))
    out = fused_moe(x, *fp8[:2], *fp8[2:])
    ref = fused_moe_ref(x, *fp8)
    assert rel(out, ref) < 1e-5
    # e4m3's rounding of weights and activations: a few percent off the unquantized layer.
    assert rel(out, fused_moe_ref(x, w13, w2, weights, ids, first)) < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,tolerance", [(False, 1e-2), (True, 2e-2)])
@pytest.mark.parametrize("local,first", [(128, 0), (64, 64)])
def test_fused_moe_in_bf16_and_in_a_cuda_graph(fp8, tolerance, local, first):
    """Qwen3-30B-A3B's layer (H 2048, 128 experts, top-8, I 768) in bf16 at decode batches
    (tp_bench's 64 and 128) and a prefill chunk, whole on one GPU or the second half of the
    experts (expert parallel over two: `local` experts from `first`): near the reference (the
    GEMMs add their products in another order; an FP8 activation's rounding can then flip
    too), and a CUDA graph of it replays onto new inputs what an eager call gives, bit for
    bit."""
    torch.manual_seed(0)
    hidden, experts, top_k, inter = 2048, 128, 8, 768
    w13 = torch.randn(local, 2 * inter, hidden, device="cuda") * hidden ** -0.5
    w2 = torch.randn(local, hidden, inter, device="cuda") * inter ** -0.5
    if fp8:
        (w13, w13_scale), (w2, w2_scale) = (quantize_weight(w.flatten(0, 1)) for w in (w13, w2))
        weights = (w13.view(local, 2 * inter, hidden), w2.view(local, hidden, inter),
                   w13_scale.view(local, -1), w2_scale.view(local, -1))
    else:
        weights = (w13.bfloat16(), w2.bfloat16(), None, None)

    def moe(fn, x, route):
        return fn(x, *weights[:2], *route, first, *weights[2:])

    def routing(tokens):
        values, ids = torch.rand(tokens, experts, device="cuda").topk(top_k)
        return values.bfloat16(), ids        # the model's router weights: its dtype

    for tokens in (1, 64, 128, 1000):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        route = routing(tokens)
        out, ref = moe(fused_moe, x, route), moe(fused_moe_ref, x, route)
        # (A token none of whose experts this half holds gets zeros.)
        assert rel(out, ref) < tolerance if ref.any() else not out.any()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(fused_moe, x, route)        # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(fused_moe, x, route)
        x.copy_(torch.randn_like(x))
        for held, new in zip(route, routing(tokens)):
            held.copy_(new)
        graph.replay()
        assert torch.equal(captured, moe(fused_moe, x, route))


def test_tiles_fit_shared_memory_for_real_shapes():
    """Qwen3-30B-A3B (H 2048, 128 experts, top-8, I 768) whole and on 8 ranks' slices, from
    decode to prefill batches: BLOCK_M grows with the rows per expert, and the pipeline's
    tiles fit a Hopper SM's 227 KB of shared memory."""
    seen = set()
    for tokens in (1, 64, 256, 512, 4096):
        for n, k in ((1536, 2048), (2048, 768), (192, 2048), (2048, 96)):
            for fp8 in (False, True):
                cfg = tiles(tokens * 8, 128, n, k, fp8)
                seen.add(cfg.block_m)
                stage_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k * (1 if fp8 else 2)
                assert cfg.num_stages * stage_bytes <= 232448 and cfg.block_k >= 32
    assert seen == {16, 32, 64}
