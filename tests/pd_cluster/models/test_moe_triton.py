"""Mixture-of-experts engines (Qwen3-MoE, Mixtral) with their experts on
kernels/fused_moe_triton.py, its pairs sorted by moe_align's one-launch kernel (on a CPU
under Triton's interpreter), give the torch backend's greedy output (kernels/fused_moe.py's
reference). ops.fused_moe takes the kernel for CUDA tensors only, so here the Triton
backend's engine is sent to it by hand. On a GPU, with CUDA graphs: test_moe_gpu.py."""
from kernels.testing import use_interpreter_without_gpu

use_interpreter_without_gpu()

import pytest  # noqa: E402

from kernels import fused_moe_triton  # noqa: E402
from pd_cluster import LLM, SamplingParams  # noqa: E402
from pd_cluster.models import ops  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402


@pytest.mark.slow       # the interpreter runs the kernels in Python
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_moe_kernel_in_an_engine_gives_the_references_tokens(family, tiny_model_root,
                                                                   monkeypatch):
    reference, kernel_calls = ops.fused_moe, []

    def experts(x, *args):
        if ops._kernels is None:            # the torch backend
            return reference(x, *args)
        kernel_calls.append(x.shape[0])
        return fused_moe_triton.fused_moe(x, *args)

    monkeypatch.setattr(ops, "fused_moe", experts)
    d = make_tiny_model(family, tiny_model_root)
    # 31 prompt tokens in a 16-token budget: two full steps, then batches of 3 (the last
    # prompt token with two decodes, then three decodes).
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 4], list(range(40, 60))]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in
             LLM(d, attention_backend=b, max_num_batched_tokens=16).generate(prompts, greedy)]
            for b in ("triton", "torch")]
    assert runs[0] == runs[1]
    # Prefill chunks and decode batches alike went through the kernel.
    assert 3 in kernel_calls and max(kernel_calls) == 16
