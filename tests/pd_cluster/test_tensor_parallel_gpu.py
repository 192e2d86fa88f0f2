"""GPU, two ranks: a tensor-parallel engine with CUDA graphs and the peer all-reduce gives one
GPU's greedy tokens, and launching its steps never waits for the device (async scheduling)."""
import os

# fp32 comparisons need full-precision tl.dot (Triton's fp32 default is TF32).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.launch_checks import assert_mixed_prompts_never_wait  # noqa: E402
from pd_cluster import LLM, SamplingParams  # noqa: E402
from pd_cluster.distributed import get_tp  # noqa: E402
from tests.support.tiny_models import make_tiny_model, mixed_prompts  # noqa: E402

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _greedy(model_dir: str, tp: int) -> list[list[int]]:
    with LLM(model_dir, dtype="float32", device="cuda", tensor_parallel_size=tp,
             max_num_batched_tokens=32, max_model_len=512, max_num_seqs=16) as llm:
        if tp > 1:
            assert llm.engine.runner.graphs is not None and get_tp().peer is not None
        return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(), GREEDY)]


@pytest.mark.parametrize("family", ["llama_gqa", "qwen3_qknorm"])
def test_tp2_with_graphs_and_peer_all_reduce_gives_one_gpus_tokens(family, tiny_model_root):
    model_dir = make_tiny_model(family, tiny_model_root)
    assert _greedy(model_dir, 2) == _greedy(model_dir, 1)


def test_tp2_launching_a_step_never_waits_for_the_device(tiny_model_root):
    llm = LLM(make_tiny_model("llama_gqa", tiny_model_root), dtype="bfloat16", device="cuda",
              tensor_parallel_size=2, max_num_batched_tokens=64, max_model_len=512)
    try:
        engine = llm.engine
        assert_mixed_prompts_never_wait(engine, GREEDY)
    finally:
        llm.close()
