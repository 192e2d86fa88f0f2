"""Test support: run the kernels on CPU under Triton's interpreter when there is no GPU."""
from __future__ import annotations

import os

import torch


def use_interpreter_without_gpu() -> bool:
    """Turn on TRITON_INTERPRET=1 unless CUDA is available; returns whether it is on.

    Call it before importing any kernel module: Triton decides at decoration time whether a
    @triton.jit function compiles or interprets.
    """
    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    _fix_interpreter_loop_bounds()
    return True


def _fix_interpreter_loop_bounds() -> None:
    # Triton 3.6's interpreter turns a tensor loop bound into an int with int() of a shape-(1,)
    # array, which NumPy >= 2.4 rejects (triton-lang/triton#9171, fixed upstream in #9172).
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "loop_bound_fix", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.loop_bound_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
