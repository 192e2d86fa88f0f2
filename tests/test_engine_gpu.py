"""GPU: the Triton backend (with CUDA graphs) gives the torch backend's greedy output."""
import os

# fp32 comparisons need full-precision tl.dot (Triton's fp32 default is TF32).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402
import torch  # noqa: E402

from pd_cluster import LLM, SamplingParams
from tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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
    engine, execute = llm.engine, llm.engine.runner.execute
    launches = []

    def strict_execute(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launches.append(execute(*args, **kwargs))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return launches[-1]

    engine.runner.execute = strict_execute
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
        engine.add_request(p, sampled)
    while engine.has_unfinished():
        engine.step()
    assert len(launches) > 24 and engine.kv.num_free_blocks == engine.kv.num_blocks
