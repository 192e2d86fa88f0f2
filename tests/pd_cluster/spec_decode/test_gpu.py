"""GPU: speculative decoding with the Triton kernels, CUDA graphs and async scheduling (the
GPU defaults) gives plain greedy decoding's output, and verification steps replay the decode
CUDA graphs."""
import os

# fp32 comparisons need full-precision tl.dot (Triton's fp32 default is TF32).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402

from pd_cluster import LLM, SamplingParams  # noqa: E402
from tests.support.spec_decode import loopy_model  # noqa: E402
from tests.support.tiny_models import mixed_prompts  # noqa: E402

pytestmark = pytest.mark.gpu       # skipped without CUDA (conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cuda", max_num_batched_tokens=64, max_model_len=512,
              max_num_seqs=32)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_equals_plain_with_graphs(method, tiny_model_root):
    model_dir = loopy_model("qwen3_qknorm", tiny_model_root)
    prompts = mixed_prompts()
    plain = LLM(model_dir, **ENGINE).generate(prompts, GREEDY)
    spec = {"method": "ngram"} if method == "ngram" else {
        "method": "draft_model", "draft_model": model_dir, "draft_num_kv_blocks": 256}
    llm = LLM(model_dir, **ENGINE, speculative={**spec, "num_speculative_tokens": 4})
    graphs, replays = llm.engine.runner.graphs, []
    run = graphs.run

    def counted(input_ids, positions, meta):
        replays.append(input_ids.shape[0])
        return run(input_ids, positions, meta)

    graphs.run = counted
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec.stats
    assert stats.accepted > 0
    # Some replays had more rows than sequences: verification steps ran as graphs.
    assert stats.steps > 0 and max(replays) > len(prompts)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
