"""FP8 KV cache (`kv_cache_dtype: fp8`): kernels against their torch references, the torch
backend, scale calibration, the layout check, transports moving fp8 blocks, and engines.

Kernels run under TRITON_INTERPRET=1 on CPU in fp32 without a GPU (bf16 on a GPU). Against
the reference on the same fp8 cache (both read fp8 * scale) they agree as the 16/32-bit
kernels do (1e-4 in fp32). Stores: x / scale rounded to e4m3 (to nearest even: on the CPU
kernels/testing.py fixes the interpreter's own rounding, which is not the GPU's), the same
bits as the reference but where the two compute x (RoPE) in a different order: at most one
e4m3 step (1/8 relative) on under 1% of elements. Against attention over the
unquantized cache: e4m3 keeps 3 mantissa bits (relative error up to 2^-4 an element, about
2% on average); a one-token context returns its V as stored, so the bound is 2^-4 of max |V|
(plus a little for K's share), and over longer contexts the errors average out: on
unit-variance K and V the mean error is about 0.009 (asserted: max <= 0.08 max |V|, mean
<= 0.015).

Engines on a tiny random Llama (tests/support/tiny_models.py), fp8 KV against auto (fp32 on a CPU),
measured on the auto engine's own greedy path of 64 steps (each prefix fed to both): the
fp8 engine picks the same token at 56/64 steps (88%), and the log-prob it gives the auto
engine's token differs by at most 0.89 (asserted: >= 48/64, <= 1.5). Left to run freely,
the two paths part after 5 tokens on that prompt. This model is far more sensitive than a
real one: running it all in bf16 moves its log-probs by up to 0.25, and its layer 1 K differs
by 6% on average; SmolLM2-135M (fp32 on a CPU) gave 96% teacher-forced agreement. Against
itself, fp8 is exact: chunked prefill and prefix hits read the same fp8 blocks.
"""
from tests.support.fp8_kv import (ATTN_TOL, DEVICE, DTYPE, INTERPRETED, K_SCALE, KV_SCALE,
                                   V_SCALE, fp8_caches)

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.fp8_math import FP8, quantize  # noqa: E402
from kernels.paged import widen_e4m3  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from kernels.reference import (decode_attention_ref, paged_attention_ref, rope_ref,  # noqa: E402
                               store_kv_ref)
from kernels.rope import build_cos_sin_cache, rope_store_kv  # noqa: E402
from tests.support.kv import model_kv, paged_kv, tiny_layout  # noqa: E402
from pd_cluster import LLM, SamplingParams  # noqa: E402
from pd_cluster.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pd_cluster.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pd_cluster.kv_scales import ScaledKVBackend, calibration_ids, pow2_scale  # noqa: E402
from pd_cluster.models.layers import RotaryEmbedding  # noqa: E402
from tests.support.attention import build_batch  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402
from transfer.base import LayoutMismatchError  # noqa: E402
from transfer.messages import KVDescriptor, KVShard  # noqa: E402
from transfer.registry import make_transport  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

TOL = 1e-4 if INTERPRETED else 2e-2


def quantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return quantize(cache, scale)


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, scale: float,
                     same: float = 0.99) -> None:
    """The same e4m3 values but where x was computed in another order (at most one step
    apart, on under 1 - `same` of the elements)."""
    g, w = got.float() * scale, want.float() * scale
    assert torch.all((g - w).abs() <= w.abs() / 8 + 2.0 ** -9 * scale)
    assert (got.view(torch.uint8) == want.view(torch.uint8)).float().mean() > same


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# -- kernels ---------------------------------------------------------------------------------
def test_store_writes_value_over_scale_saturated_and_skips_padding():
    tokens, heads, kv_heads, head_dim, bs = 11, 4, 2, 64, 16
    cos_sin = build_cos_sin_cache(1.0 / (10000.0 ** (torch.arange(0, head_dim, 2,
                                                                  device=DEVICE) / head_dim)), 64)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    v[0, 0, :4] = torch.tensor([1e4, -1e4, 3.0, 1e-6])    # past +-448 * scale: saturates
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    slots = torch.randperm(3 * bs, device=DEVICE)[:tokens]
    slots[5] = -1
    k_cache, v_cache = (torch.zeros(3, bs, kv_heads, head_dim, device=DEVICE, dtype=FP8)
                        for _ in range(2))
    ref_q, _ = rope_ref(q, k, positions, cos_sin)
    # The kernel quantizes its fp32 rotation: so does the reference (rope_ref rounds to the
    # model dtype first, which in bf16 moved 1.5% of K's e4m3 values by a step on an H100).
    _, ref_k = rope_ref(q.float(), k.float(), positions, cos_sin)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    store_kv_ref(ref_k, v, ref_k_cache, ref_v_cache, slots, KV_SCALE)
    rope_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, KV_SCALE)
    torch.testing.assert_close(q, ref_q, atol=TOL, rtol=TOL)
    assert_fp8_close(k_cache, ref_k_cache, K_SCALE)
    assert_fp8_close(v_cache, ref_v_cache, V_SCALE)
    stored = v_cache.view(-1, kv_heads, head_dim)[slots[0]].float()[0, :2]
    assert stored.tolist() == [448.0, -448.0]
    assert torch.count_nonzero(v_cache.view(torch.uint8)) > 0


def assert_near_exact(out: torch.Tensor, exact: torch.Tensor, v: torch.Tensor) -> None:
    """fp8 KV attention against attention over the caches it quantized (module docstring)."""
    err = (out.float() - exact.float()).abs()
    print(f"fp8 vs exact KV: max {err.max():.4f} (max |V| {v.abs().max():.2f}), "
          f"mean {err.mean():.4f}")
    assert err.max() <= 0.08 * v.abs().max() and err.mean() <= 0.015


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_reads_fp8_times_scale(num_splits):
    seq_lens, heads, kv_heads, head_dim = [1, 37, 100, 70], 8, 2, 64
    (k, v), (k8, v8), table = fp8_caches(seq_lens, 16, kv_heads, head_dim)
    q = torch.randn(len(seq_lens), heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = decode_attention(q, k8, v8, table, lens, scale, max(seq_lens), block_n=16,
                           num_splits=num_splits, kv_scale=KV_SCALE)
    ref = decode_attention_ref(q, k8, v8, table, lens, scale, KV_SCALE)
    torch.testing.assert_close(out, ref, atol=ATTN_TOL, rtol=ATTN_TOL)
    exact = decode_attention_ref(q, k, v, table, lens, scale)
    assert_near_exact(out, exact, v)


@triton.jit
def _widen_kernel(X, Out, PTX: tl.constexpr):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(Out + offs, widen_e4m3(tl.load(X + offs), PTX))


@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_widening_gives_every_e4m3_value_exactly(ptx):
    every = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(FP8).view(16, 16)
    out = torch.empty(16, 16, dtype=torch.float16, device=DEVICE)
    _widen_kernel[(1,)](every, out, PTX=ptx)
    finite = ~every.float().isnan()     # e4m3's two NaNs: a cache never holds them (stores
    assert torch.equal(out[finite], every.to(torch.float16)[finite])    # saturate at 448)


@pytest.mark.gpu
# The launcher's programs (kernels/decode_attention.py): 64 x <= 1k tokens: 4 warps; 24 / 96
# past 1k: one warp, transposed, in splits; 160: one warp, one split; 256: one warp over
# 16-token tiles (2048 programs)
@pytest.mark.parametrize("batch,max_len", [(24, 4096), (64, 1024), (96, 4096), (160, 4096),
                                           (256, 4096)])
def test_decode_kernel_reads_fp8_at_real_shapes(batch, max_len):
    seq_lens = torch.randint(1, max_len + 1, (batch,)).tolist()
    heads, kv_heads, head_dim = 32, 8, 128
    (k, v), (k8, v8), table = fp8_caches(seq_lens, 16, kv_heads, head_dim)
    q = torch.randn(batch, heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k8, v8, table, lens, head_dim ** -0.5, max(seq_lens),
                           kv_scale=KV_SCALE)
    ref = decode_attention_ref(q, k8, v8, table, lens, head_dim ** -0.5, KV_SCALE)
    torch.testing.assert_close(out, ref, atol=ATTN_TOL, rtol=ATTN_TOL)


def test_prefill_kernel_reads_fp8_times_scale():
    cached_and_new = [(0, 37), (32, 13), (17, 1), (45, 20)]
    seq_lens = [c + n for c, n in cached_and_new]
    heads, kv_heads, head_dim = 4, 2, 64
    (k, v), (k8, v8), table = fp8_caches(seq_lens, 16, kv_heads, head_dim)
    q_lens = [n for _, n in cached_and_new]
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, head_dim, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = prefill_attention(q, k8, v8, table, lens, starts, max(q_lens), scale, block_m=16,
                            block_n=16, kv_scale=KV_SCALE)
    ref = paged_attention_ref(q, k8, v8, table, lens, starts, scale, KV_SCALE)
    torch.testing.assert_close(out, ref, atol=ATTN_TOL, rtol=ATTN_TOL)
    exact = paged_attention_ref(q, k, v, table, lens, starts, scale)
    assert_near_exact(out, exact, v)


def test_a_cache_without_its_scales_is_refused():
    (_, _), (k8, v8), table = fp8_caches([5], 16, 2, 64)
    q = torch.randn(1, 4, 64, dtype=DTYPE, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError):
        decode_attention(q, k8, v8, table, lens, 0.125, 5)


@pytest.mark.slow
@pytest.mark.parametrize("cached,new", [([40, 7, 100, 0, 33], [1, 1, 1, 21, 9]),
                                        ([0, 48], [30, 17])])
def test_backends_store_and_attend_fp8_alike(cached, new):
    """Triton and torch backends, through the wrapper that picks each layer's scales."""
    heads, kv_heads, head_dim, bs, num_blocks, layers = 4, 2, 64, 16, 40, 2
    meta = build_batch(cached, new, bs, num_blocks)
    tokens = sum(new)
    q = torch.randn(tokens, heads, head_dim, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
            for _ in range(2))
    kv = torch.zeros(layers, 2, num_blocks, bs, kv_heads, head_dim, dtype=FP8,
                     device=DEVICE)
    kv[:, :, :, :] = quantized(torch.randn(kv.shape, device=DEVICE), 1.0)
    ref_kv = kv.clone()
    scales = torch.tensor([[1.0, 1.0], [K_SCALE, V_SCALE]], device=DEVICE)
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None).to(DEVICE)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)]).to(DEVICE)
    torch_be = ScaledKVBackend(TorchAttentionBackend(), ref_kv, scales)
    triton_be = ScaledKVBackend(TritonAttentionBackend(), kv, scales)
    assert triton_be.layer_of(kv[1][0]) == 1 and triton_be.name == "triton"
    ref = torch_be.forward(q.clone(), k, v, positions, rope, ref_kv[1][0], ref_kv[1][1], meta,
                           head_dim ** -0.5)
    out = triton_be.forward(q, k, v, positions, rope, kv[1][0], kv[1][1], meta,
                            head_dim ** -0.5)
    # The torch backend rotates K in the model dtype before quantizing (bf16: more steps).
    assert_fp8_close(kv[1, 0], ref_kv[1, 0], K_SCALE, 0.99 if INTERPRETED else 0.95)
    assert_fp8_close(kv[1, 1], ref_kv[1, 1], V_SCALE)
    assert torch.equal(kv[0].view(torch.uint8), ref_kv[0].view(torch.uint8))  # layer 0 intact
    torch.testing.assert_close(out, ref, atol=TOL * 10, rtol=TOL * 10)


# -- scales ----------------------------------------------------------------------------------
def test_scales_round_up_to_powers_of_two_with_a_floor():
    for amax in (1e-9, 0.3, 1.0, 7.0, 224.0, 448.0, 1000.0, 3.3e4):
        s = pow2_scale(amax)
        assert math.frexp(s)[0] == 0.5                    # a power of two
        wanted = amax * 2.0 / 448.0
        assert s >= wanted and (s < 2 * wanted or s == 2.0 ** -10)
    assert pow2_scale(224.0) == 1.0 and pow2_scale(224.0 + 1e-3) == 2.0   # exact: not up
    assert pow2_scale(0.0) == 2.0 ** -10
    with pytest.raises(ValueError):
        pow2_scale(float("nan"))
    assert calibration_ids(512, 5) == calibration_ids(512, 5) and max(calibration_ids(7, 64)) < 7


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def fp8_llm(tiny):
    return LLM(tiny, kv_cache_dtype="fp8", num_kv_blocks=64)


@pytest.fixture(scope="module")
def auto_llm(tiny):
    return LLM(tiny, num_kv_blocks=64)


def test_calibration_is_deterministic_and_gives_powers_of_two(tiny, fp8_llm):
    runner = fp8_llm.engine.runner
    layout = fp8_llm.engine.kv_layout
    assert layout.dtype == "float8_e4m3fn" and layout.kv_scales == runner.kv_scales
    assert len(runner.kv_scales) == 2
    assert all(math.frexp(s)[0] == 0.5 for pair in runner.kv_scales for s in pair)
    assert runner.kv_cache.dtype == FP8 and runner.kv_cache.element_size() == 1
    assert runner.kv_scale_tensor.tolist() == [list(p) for p in runner.kv_scales]
    again = LLM(tiny, kv_cache_dtype="fp8", num_kv_blocks=8, max_model_len=200)
    assert again.engine.kv_layout.kv_scales == layout.kv_scales


@pytest.mark.slow
def test_tensor_parallel_ranks_calibrate_the_same_scales(tiny, fp8_llm):
    """Two gloo ranks, each with one of the two KV heads: the max over the ranks, so the
    scales (and the tokens) are tp = 1's."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = [list(range(5, 70))]
    with LLM(tiny, kv_cache_dtype="fp8", num_kv_blocks=32, tensor_parallel_size=2) as tp2:
        assert [lay.kv_scales for _, lay in tp2.engine.kv_shards()] == \
            [fp8_llm.engine.kv_layout.kv_scales] * 2
        got = tp2.generate(prompt, params)[0].outputs[0].token_ids
    assert got == fp8_llm.generate(prompt, params)[0].outputs[0].token_ids


def test_checkpoint_scales_are_used_as_given(tiny, monkeypatch):
    from pd_cluster import model_runner

    load = model_runner.load_model

    def with_scales(*args, **kwargs):
        model = load(*args, **kwargs)
        model.kv_scales = [(0.0123, 0.5), None]   # layer 1: none, so it is calibrated
        return model
    monkeypatch.setattr(model_runner, "load_model", with_scales)
    llm = LLM(tiny, kv_cache_dtype="fp8", num_kv_blocks=8)
    scales = llm.engine.kv_layout.kv_scales
    assert scales[0] == (0.0123, 0.5) and math.frexp(scales[1][0])[0] == 0.5


# -- layout and transports -------------------------------------------------------------------
def test_layout_check_names_dtypes_and_scales():
    fp8 = tiny_layout(dtype="float8_e4m3fn", kv_scales=((0.5, 0.25), (1.0, 0.125)))
    assert fp8.block_bytes == 4 * 2 * 16 and fp8.head_bytes == 16      # one byte an element
    why = tiny_layout().mismatch(fp8)
    assert "'bfloat16' != 'float8_e4m3fn'" in why and "kv_scales" not in why
    other = tiny_layout(dtype="float8_e4m3fn", kv_scales=((0.5, 0.25), (2.0, 0.125)))
    assert "layer 1: (K, V) (1.0, 0.125) != (2.0, 0.125)" in fp8.mismatch(other)
    assert fp8.mismatch(tiny_layout(dtype="float8_e4m3fn", kv_scales=[[0.5, 0.25],
                                                                      [1.0, 0.125]])) is None
    desc = KVDescriptor("nixl", "a", (KVShard(fp8, 4096, 0),), False, b"")
    assert KVDescriptor.decode(desc.encode()) == desc            # scales survive msgpack
    with pytest.raises(ValueError, match="layers of KV scales"):
        tiny_layout(dtype="float8_e4m3fn", kv_scales=((1.0, 1.0),))


@pytest.mark.parametrize("backend", ["local", "nixl", "ucx"])
def test_transports_move_fp8_blocks_byte_exact(backend):
    scales = ((0.0625, 0.0625), (0.0625, 0.0625))
    layout = tiny_layout(dtype="float8_e4m3fn", kv_scales=scales)
    src = paged_kv(layout, quantized(model_kv(tiny_layout(dtype="float32"), 22, seed=3),
                                     0.0625), [3, 4, 5, 6, 10, 11])
    a, b = make_transport(backend), make_transport(backend)
    a.register(src, layout)
    b_layout = tiny_layout(dtype="float8_e4m3fn", kv_scales=scales, num_blocks=24)
    b.register(b_layout.allocate(), b_layout)
    try:
        a.connect(b.descriptor().encode())
        b.connect(a.descriptor())
        target = b.expect(a.name, "w")
        t = a.write(b.name, [3, 4, 5, 6, 10, 11], [0, 1, 2, 7, 8, 20], transfer_id="w")
        wait_until(lambda: all([a.poll(t).finished, b.poll(target).finished]), 10, 1e-3)
        t.raise_if_failed()
        assert torch.equal(b.kv[:, :, [0, 1, 2, 7, 8, 20]].view(torch.uint8),
                           src[:, :, [3, 4, 5, 6, 10, 11]].view(torch.uint8))
        c = make_transport(backend)
        c.register(tiny_layout().allocate(), tiny_layout())
        with pytest.raises(LayoutMismatchError, match="'float8_e4m3fn' != 'bfloat16'"):
            a.connect(c.descriptor())
        c.close()
    finally:
        a.close()
        b.close()


# -- engines ---------------------------------------------------------------------------------
GREEDY64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=20)


def test_fp8_engine_follows_the_auto_engine_on_its_greedy_path(auto_llm, fp8_llm):
    """Per step of the auto engine's 64-token greedy path (each prefix fed to both): the
    same argmax at most steps, the path's log-probs close (module docstring's figures)."""
    prompt = list(range(5, 70))
    path = auto_llm.generate([prompt], GREEDY64)[0].outputs[0].token_ids
    prefixes = [prompt + path[:i] for i in range(len(path))]
    ours = fp8_llm.generate(prefixes, ONE)
    theirs = auto_llm.generate(prefixes, ONE)
    same = sum(o.outputs[0].token_ids == t.outputs[0].token_ids for o, t in zip(ours, theirs))
    gaps = [abs(o.outputs[0].logprobs[0].get(tok, -math.inf) - t.outputs[0].logprobs[0][tok])
            for o, t, tok in zip(ours, theirs, path)]
    print(f"fp8 vs auto on 64 greedy steps: same argmax {same}/64, |dlogprob| of the path's "
          f"token max {max(gaps):.3f}")
    assert same >= 48 and max(gaps) <= 1.5


def test_fp8_chunked_prefill_and_prefix_hits_equal_fp8_unchunked(tiny, fp8_llm):
    prompts = [list(range(3, 90)), list(range(3, 60)) + [7, 8], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny, kv_cache_dtype="fp8", num_kv_blocks=64, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    chunked = LLM(tiny, kv_cache_dtype="fp8", num_kv_blocks=64, max_num_batched_tokens=24)
    for _ in range(2):      # the second round hits the prefix cache
        assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == want
    assert chunked.engine.scheduler.stats.prefix_hits > 0


def test_profile_counts_one_kv_byte_an_element(auto_llm, fp8_llm):
    from pd_cluster.tuning.measure import model_info

    fp8, auto = model_info(fp8_llm.engine), model_info(auto_llm.engine)
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and auto["kv_cache_dtype"] == "float32"
    assert fp8["kv_bytes_per_token"] == 2 * 2 * 2 * 16 == auto["kv_bytes_per_token"] // 4


def test_kv_cache_sized_from_memory_at_one_byte_an_element(tiny):
    llm = LLM(tiny, kv_cache_dtype="fp8", kv_cache_memory_gb=0.01)
    block_bytes = 2 * 2 * 16 * 2 * 16        # layers x (K, V) x tokens x KV heads x dims
    assert llm.engine.kv_layout.num_blocks == int(0.01 * 2**30) // block_bytes
