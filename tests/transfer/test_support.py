"""The transfer tests' KV helpers (tests/support/kv.py): real K/V, laid out as the engine does."""
from __future__ import annotations

import pytest
import torch

from tests.support.kv import model_kv, paged_kv, tiny_layout


@pytest.mark.slow
def test_model_kv_is_deterministic_and_fills_blocks() -> None:
    layout = tiny_layout()
    kv = model_kv(layout, 10, seed=1)
    assert kv.shape == (2, 2, 10, 2, 16) and torch.equal(kv, model_kv(layout, 10, seed=1))
    cache = paged_kv(layout, kv, [5, 9, 2])
    assert torch.equal(cache[:, :, 9], kv[:, :, 4:8]) and kv.abs().sum() > 0
    assert torch.count_nonzero(cache[:, :, 2, 2:]) == 0  # padding of the partial last block
