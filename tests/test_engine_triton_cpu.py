"""The engine with the Triton attention backend (CPU interpreter) matches the torch backend."""
from kernels.testing import use_interpreter_without_gpu

use_interpreter_without_gpu()

from pd_cluster import LLM, SamplingParams  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


def test_triton_backend_greedy_equals_torch_backend(tiny_model_root):
    d = make_tiny_model("qwen3_qknorm", tiny_model_root)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 4], list(range(40, 90))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in
             LLM(d, attention_backend=b, max_num_batched_tokens=16).generate(prompts, greedy)]
            for b in ("triton", "torch")]
    assert runs[0] == runs[1]


def test_warm_up_leaves_no_trace(tiny_model_root):
    """The throwaway requests that compile kernels before serving (run on GPU at start) leave
    no request, no held block, no prefix-cache entry and no counted hit behind, and the
    engine's answers afterwards are a fresh engine's."""
    d = make_tiny_model("qwen3_qknorm", tiny_model_root)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fresh = LLM(d, attention_backend="triton", max_num_batched_tokens=16)
    warmed = LLM(d, attention_backend="triton", max_num_batched_tokens=16)
    engine = warmed.engine
    engine.warm_up()
    assert not engine.has_unfinished() and not engine.scheduler.requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.kv.pool._by_hash
    assert engine.scheduler.stats.prefix_queries == engine.scheduler.stats.prefix_hits == 0
    assert ([o.outputs[0].token_ids for o in warmed.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy)])
