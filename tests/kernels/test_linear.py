"""The small-batch GEMM kernel against torch, and how the dispatcher chooses it.

CPU: TRITON_INTERPRET=1 in fp32 (the interpreter's tl.dot is wrong on bf16), small shapes.
GPU: bf16 at Llama-3.1-8B shapes; relative error of bf16 operands with fp32 accumulation
lands well under 1e-2 (cuBLAS' own is the same order).
"""
from kernels.testing import use_interpreter_without_gpu

INTERPRETED = use_interpreter_without_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.linear import MAX_ROWS, Dispatch, linear  # noqa: E402
from kernels.reference import linear_ref  # noqa: E402

DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPE = torch.float32 if INTERPRETED else torch.bfloat16
# Timing and real shapes need a CUDA GPU: those tests are marked gpu (skipped without one).


def rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = linear_ref(x, w)
    return ((out.double() - ref).norm() / ref.norm()).item()


# Rows below one tile, one ragged tile and two tiles; K a multiple of the tile and not; both
# tile shapes (K >= 8192 takes the narrow, deep one).
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 200, 300), (64, 64, 384), (70, 40, 8200),
                                   (130, 72, 256)])
def test_linear_matches_matmul(m, n, k):
    x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
    w = torch.randn(n, k, dtype=DTYPE, device=DEVICE)
    assert rel_err(linear(x, w), x, w) < (1e-5 if INTERPRETED else 1e-2)


def test_dispatch_outside_measuring_takes_cublas_and_records_nothing():
    dispatch = Dispatch()
    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    assert torch.equal(dispatch(x, w), F.linear(x, w))
    assert dispatch.choice == {}


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 48, 64])
def test_dispatch_measures_once_and_matches_matmul(m, n, k):
    dispatch = Dispatch()
    x = torch.randn(m, k, dtype=DTYPE, device=DEVICE)
    w = torch.randn(n, k, dtype=DTYPE, device=DEVICE) * k ** -0.5
    dispatch.measuring = True
    first = dispatch(x, w)
    assert (m, n, k) in dispatch.choice
    dispatch.measuring = False
    assert rel_err(first, x, w) < 1e-2 and rel_err(dispatch(x, w), x, w) < 1e-2
    big = torch.randn(MAX_ROWS + 1, k, dtype=DTYPE, device=DEVICE)  # cuBLAS, unmeasured
    assert torch.equal(dispatch(big, w), F.linear(big, w)) and len(dispatch.choice) == 1


def test_dispatch_leaves_fp32_to_cublas_even_while_measuring():
    dispatch = Dispatch()
    dispatch.measuring = True
    x, w = torch.randn(8, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    assert torch.equal(dispatch(x, w), F.linear(x, w)) and dispatch.choice == {}
