"""The MoE router's kernel (kernels/moe_router.py) against its torch reference
(kernels/reference.py router_topk_ref): Qwen3's softmax top-k, DeepSeek-V2's scaled softmax
without renormalisation, and V3's biased sigmoid choice; on a CPU under TRITON_INTERPRET=1."""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.moe_router import router_topk  # noqa: E402
from kernels.reference import router_topk_ref  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"


@pytest.mark.slow      # the interpreter, a program per token
@pytest.mark.parametrize("experts,top_k,sigmoid,bias,renormalize,scale", [
    (128, 8, False, False, True, 1.0),      # Qwen3-30B-A3B
    (64, 6, False, False, False, 1.0),      # DeepSeek-V2-Lite
    (60, 6, True, True, True, 2.5),         # V3's choice, an expert count no power of two
])
def test_router_kernel_chooses_and_weighs_as_the_reference(experts, top_k, sigmoid, bias,
                                                           renormalize, scale):
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(6, experts, generator=gen) * 3).to(DEVICE)
    correction = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if bias else None
    args = (correction, top_k, sigmoid, renormalize, 1e-20, scale, torch.float32)
    weights, ids = router_topk(logits, *args)
    want_weights, want_ids = router_topk_ref(logits, *args)
    assert ids.dtype == torch.int64 and ids.shape == (6, top_k)
    assert torch.equal(ids, want_ids)           # best first, as torch's sorted top-k
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_router_kernel_takes_an_empty_batch():
    weights, ids = router_topk(torch.empty(0, 64, device=DEVICE), None, 6, False, True, 0.0,
                               1.0, torch.float32)
    assert weights.shape == ids.shape == (0, 6)
