"""A DeepSeek engine on the Triton attention backend decodes with the MLA kernel
(kernels/mla_decode.py; on a CPU under Triton's interpreter) and gives the torch backend's
greedy output."""
from kernels.testing import use_interpreter_without_gpu

use_interpreter_without_gpu()

import pytest  # noqa: E402

from pd_cluster import LLM, SamplingParams  # noqa: E402
from tests.support.tiny_deepseek import make_tiny_deepseek  # noqa: E402


@pytest.mark.slow       # the interpreter runs the kernel in Python
def test_triton_backend_greedy_equals_torch_backend(tiny_model_root):
    d = make_tiny_deepseek("deepseek_v3", tiny_model_root)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 4], list(range(40, 70))]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in
             LLM(d, attention_backend=b, max_num_batched_tokens=16).generate(prompts, greedy)]
            for b in ("triton", "torch")]
    assert runs[0] == runs[1]
