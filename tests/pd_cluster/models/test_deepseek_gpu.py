"""GPU: DeepSeek-V2/V3 (multi-head latent attention, grouped routing, shared experts) through
the Triton backend, whose decode steps run the latent kernel (kernels/mla_decode.py) and the
fused experts inside CUDA graphs, give the torch backend's greedy tokens (absorbed decode in
torch, eagerly); launching their steps never waits for the device; and the DeepSeek MoE
layers' routed-expert counters (bench/tp_bench.py's roofline) count graph replays. The kernel
alone at V2-Lite's and V3's widths: tests/kernels/test_mla.py; the CPU side:
tests/pd_cluster/models/test_deepseek.py."""
import os

# fp32 comparisons need full-precision tl.dot (Triton's fp32 default is TF32).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import pytest  # noqa: E402

from pd_cluster import LLM, SamplingParams  # noqa: E402
from pd_cluster.models.moe import COUNT_ROUTED, routed_counts  # noqa: E402
from tests.support.launch_checks import assert_mixed_prompts_never_wait  # noqa: E402
from tests.support.tiny_deepseek import DEEPSEEK, make_tiny_deepseek  # noqa: E402
from tests.support.tiny_models import mixed_prompts  # noqa: E402

pytestmark = pytest.mark.gpu       # skipped without CUDA (conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _greedy(model_dir: str, backend: str) -> list[list[int]]:
    with LLM(model_dir, attention_backend=backend, dtype="float32", device="cuda",
             max_num_batched_tokens=64, max_model_len=512, max_num_seqs=16) as llm:
        if backend == "triton":
            assert llm.engine.runner.graphs is not None
        return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(), GREEDY)]


@pytest.mark.parametrize("family", sorted(DEEPSEEK))
def test_triton_backend_with_graphs_gives_the_torch_backends_tokens(family, tiny_model_root):
    """fp32: the latent kernel's split softmax and the fused experts add in another order
    than torch, far below what flips a greedy token."""
    model_dir = make_tiny_deepseek(family, tiny_model_root)
    assert _greedy(model_dir, "triton") == _greedy(model_dir, "torch")


def test_launching_a_deepseek_step_never_waits_for_the_device(tiny_model_root):
    """Async scheduling over latent attention and grouped routing, in bf16: graphed decode
    steps and eager prefill chunks (expanded attention) queue work without a host sync."""
    llm = LLM(make_tiny_deepseek("deepseek_v2", tiny_model_root), dtype="bfloat16",
              device="cuda", max_num_batched_tokens=64, max_model_len=512)
    engine = llm.engine
    assert_mixed_prompts_never_wait(engine, GREEDY)


def test_deepseek_routed_counters_count_inside_the_graphs(tiny_model_root, monkeypatch):
    """Counting on: one prompt's decode steps, replayed from graphs, each count once in every
    sparse layer (V2-Lite's layout: the first dense), no expert more often than that."""
    monkeypatch.setenv(COUNT_ROUTED, "1")
    with LLM(make_tiny_deepseek("deepseek_v2_lite", tiny_model_root), dtype="bfloat16",
             device="cuda", max_num_batched_tokens=64, max_model_len=512) as llm:
        model = llm.engine.runner.model
        assert llm.engine.runner.graphs is not None
        before = routed_counts(model)
        llm.generate([list(range(3, 40))], GREEDY)
        counted = routed_counts(model) - before
    forwards = counted[:, -1]
    assert counted.shape[0] == 2        # three layers, the first dense
    assert (forwards == forwards[0]).all()
    assert GREEDY.max_tokens <= forwards[0] <= GREEDY.max_tokens + 1
    assert (counted[:, :-1] <= forwards[:, None]).all() and counted[:, :-1].sum() > 0
