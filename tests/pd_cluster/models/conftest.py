"""Fixtures of the model tests."""
from __future__ import annotations

import pytest

from tests.support.fp8_weights import write_fp8_checkpoint
from tests.support.tiny_models import make_tiny_model

FP8_FORMATS = ("fp8-tensor", "ct-channel", "ct-tensor")


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_model_root, tmp_path_factory) -> dict[str, str]:
    """The tiny llama_gqa model as an FP8 checkpoint in each published format: format -> dir."""
    src = make_tiny_model("llama_gqa", tiny_model_root)
    root = tmp_path_factory.mktemp("fp8_checkpoints")
    for fmt in FP8_FORMATS:
        write_fp8_checkpoint(src, str(root / fmt), fmt)
    return {fmt: str(root / fmt) for fmt in FP8_FORMATS}
