"""Speculative decoding through the Triton attention kernels (CPU interpreter): a verifying
sequence's k + 1 tokens go through the decode kernel as one-token rows, next to plain decodes
and prompt chunks (prefill kernel), and greedy output equals plain decoding's."""
import pytest
from kernels.testing import use_interpreter_without_gpu

use_interpreter_without_gpu()

from pd_cluster import LLM, SamplingParams  # noqa: E402
from tests.support.spec_decode import loopy_model  # noqa: E402


@pytest.mark.slow
def test_triton_backend_speculative_greedy_equals_plain(tiny_model_root):
    d = loopy_model("qwen3_qknorm", tiny_model_root)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 4], list(range(40, 90))]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(attention_backend="triton", block_size=4, max_num_batched_tokens=16)
    plain = LLM(d, **kw).generate(prompts, greedy)
    llm = LLM(d, **kw, speculative={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec.stats.accepted > 0
