"""GPU: the Triton backend (with CUDA graphs) gives the torch backend's greedy output."""
import os

# fp32 comparisons need full-precision tl.dot (Triton's fp32 default is TF32).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.launch_checks import strict_launches
from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu       # skipped without CUDA (conftest.py)

PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 4], list(range(40, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _run(model_dir, backend, dtype):
    llm = LLM(model_dir, attention_backend=backend, dtype=dtype, device="cuda",
              max_num_batched_tokens=64, max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("family", ["llama_gqa", "qwen3_qknorm"])
def test_triton_equals_torch_backend_on_tiny_model_fp32(family, tiny_model_root):
    d = make_tiny_model(family, tiny_model_root)
    assert _run(d, "triton", "float32") == _run(d, "torch", "float32")


def test_triton_equals_torch_backend_on_default_model(default_model_dir):
    # bf16 rounding differs between the two attention implementations, so compare in fp32.
    assert _run(default_model_dir, "triton", "float32") == \
        _run(default_model_dir, "torch", "float32")


def test_launching_a_step_never_waits_for_the_device(tiny_model_root):
    """Async scheduling: planning and launching step k+1 (graph decode, prefill chunks and
    sampling alike) queues work without a host-device sync, so it overlaps step k."""
    llm = LLM(make_tiny_model("llama_gqa", tiny_model_root), dtype="bfloat16", device="cuda",
              max_num_batched_tokens=64, max_model_len=512)
    engine = llm.engine
    launches = strict_launches(engine)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
        engine.add_request(p, sampled)
    while engine.has_unfinished():
        engine.step()
    assert len(launches) > 24 and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_engines_sharing_a_gpu_each_keep_to_their_share(tiny_model_root):
    """gpu_memory_utilization counts an engine's own memory only, so a second engine on the
    GPU gets its share too (counting the first one's memory against it left it nothing)."""
    d = make_tiny_model("llama_gqa", tiny_model_root)
    total = torch.cuda.mem_get_info()[1]
    # Room for many sequences, so the KV is sized by the memory share, not by max_num_seqs.
    engines = [LLM(d, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3,
                   max_num_seqs=100_000, max_model_len=4096, cuda_graphs=False)
               for _ in range(2)]
    kv = [e.engine.runner.kv_cache.numel() * e.engine.runner.kv_cache.element_size()
          for e in engines]
    assert all(0.2 * total < b <= 0.3 * total for b in kv), [b / total for b in kv]
    for e in engines:
        out = e.generate([PROMPTS[0]], GREEDY)[0]
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_graphs_for_short_and_long_contexts_both_give_the_eager_tokens(tiny_model_root):
    """max_model_len past SHORT_CONTEXT: each batch size is captured for short contexts and
    for long ones (the fp8 attention launches differently for each); a batch that crosses
    1024 tokens mid-decode moves from the one to the other, and its tokens stay the eager
    engine's."""
    d = make_tiny_model("llama_gqa", tiny_model_root)
    # The first passes 1024 tokens while decoding (the tiny model's vocabulary is 512).
    prompts = [[3 + i % 500 for i in range(1010)], [5, 9, 13]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        # fp32: the graphs size their splits for their cap, eager steps for the real contexts,
        # and bf16 sums them far enough apart to flip this random model's near-ties.
        llm = LLM(d, dtype="float32", kv_cache_dtype="fp8", device="cuda", max_model_len=2048,
                  cuda_graphs=graphs)
        if graphs:
            assert llm.engine.runner.graphs.caps == [1024, 2048]
        outs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
