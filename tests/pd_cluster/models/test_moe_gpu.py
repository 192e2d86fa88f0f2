"""GPU: mixtures of experts (Qwen3-MoE, Mixtral) through the Triton backend, whose experts run
kernels/fused_moe_triton.py inside the decode steps' CUDA graphs, give the torch backend's
greedy tokens (its experts kernels/fused_moe.py's reference, eagerly); launching their steps
never waits for the device; the routed-expert counters (pd_cluster/models/moe.py) count graph
replays; and on two GPUs, experts split whole (expert parallel) or by slice under the peer
all-reduce's graphs give one GPU's tokens. The kernel itself at Qwen3-30B-A3B's shapes:
tests/kernels/test_moe.py."""
import os

# fp32 comparisons need full-precision tl.dot (Triton's fp32 default is TF32).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402
import torch  # noqa: E402

from pd_cluster import LLM, SamplingParams  # noqa: E402
from pd_cluster.distributed import get_tp  # noqa: E402
from pd_cluster.models.moe import COUNT_ROUTED, routed_counts  # noqa: E402
from tests.support.launch_checks import assert_mixed_prompts_never_wait  # noqa: E402
from tests.support.tiny_models import make_tiny_model, mixed_prompts  # noqa: E402

pytestmark = pytest.mark.gpu       # skipped without CUDA (conftest.py)

MOE_FAMILIES = ["qwen3_moe", "mixtral"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _greedy(model_dir: str, backend: str, tp: int = 1, **engine) -> list[list[int]]:
    with LLM(model_dir, attention_backend=backend, dtype="float32", device="cuda",
             tensor_parallel_size=tp, max_num_batched_tokens=64, max_model_len=512,
             max_num_seqs=16, **engine) as llm:
        if backend == "triton":
            assert llm.engine.runner.graphs is not None
        if tp > 1:
            assert get_tp().peer is not None
        return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(), GREEDY)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_triton_backend_with_graphs_gives_the_torch_backends_tokens(family, tiny_model_root):
    """fp32: the fused kernel's GEMMs add their exact products in another order than
    torch's, far below what flips a greedy token."""
    model_dir = make_tiny_model(family, tiny_model_root)
    assert _greedy(model_dir, "triton") == _greedy(model_dir, "torch")


def test_launching_a_moe_step_never_waits_for_the_device(tiny_model_root):
    """Async scheduling over the fused MoE (moe_align sorts on the device: no host sync), in
    bf16, graphed decode steps and eager prefill chunks alike."""
    llm = LLM(make_tiny_model("qwen3_moe", tiny_model_root), dtype="bfloat16", device="cuda",
              max_num_batched_tokens=64, max_model_len=512)
    engine = llm.engine
    assert_mixed_prompts_never_wait(engine, GREEDY)


def test_routed_counters_count_inside_the_graphs(tiny_model_root, monkeypatch):
    """Counting on (bench/tp_bench.py's roofline): one prompt's decode steps, replayed from
    graphs, each count once in every sparse layer, and no expert more often than that."""
    monkeypatch.setenv(COUNT_ROUTED, "1")
    with LLM(make_tiny_model("qwen3_moe", tiny_model_root), dtype="bfloat16", device="cuda",
             max_num_batched_tokens=64, max_model_len=512) as llm:
        model = llm.engine.runner.model
        assert llm.engine.runner.graphs is not None
        before = routed_counts(model)
        llm.generate([list(range(3, 40))], GREEDY)
        counted = routed_counts(model) - before
    forwards = counted[:, -1]
    # The prefill, then a forward per further token (async scheduling may launch one more).
    assert (forwards == forwards[0]).all()
    assert GREEDY.max_tokens <= forwards[0] <= GREEDY.max_tokens + 1
    assert (counted[:, :-1] <= forwards[:, None]).all() and counted[:, :-1].sum() > 0


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_gpus_give_one_gpus_tokens(family, expert_parallel, tiny_model_root):
    """Tensor parallel over two GPUs, with CUDA graphs and the peer all-reduce: each rank's
    experts (two whole of four, or half of every one) give a partial sum the next norm
    reduces."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model_dir = make_tiny_model(family, tiny_model_root)
    assert (_greedy(model_dir, "triton", 2, enable_expert_parallel=expert_parallel)
            == _greedy(model_dir, "triton"))
