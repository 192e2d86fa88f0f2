"""The engine with the Triton attention backend (CPU interpreter) matches the torch backend."""
import pytest
from kernels.testing import use_interpreter_without_gpu

use_interpreter_without_gpu()

from pd_cluster import LLM, SamplingParams  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402


@pytest.mark.slow
def test_triton_backend_greedy_equals_torch_backend(tiny_model_root):
    d = make_tiny_model("qwen3_qknorm", tiny_model_root)
    # The long prompt takes several chunks of the 16-token budget, the later ones attending to
    # the cached earlier ones across block boundaries, next to the others' decodes.
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 4], list(range(40, 80))]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in
             LLM(d, attention_backend=b, max_num_batched_tokens=16).generate(prompts, greedy)]
            for b in ("triton", "torch")]
    assert runs[0] == runs[1]

