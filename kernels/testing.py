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
    _fix_interpreter_fp8_rounding()
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


def _fix_interpreter_fp8_rounding() -> None:
    # Triton 3.x's interpreter narrows a float to float8e4nv (e4m3) by rounding half up and
    # ORing a mantissa carry into the exponent (31.5 becomes 16, not 32), and flushes small
    # values to zero. The GPU converts round-to-nearest-even (cvt.rn.satfinite), as torch
    # does: narrowing to e4m3 goes through torch here, so the interpreter computes what the
    # GPU does. Other conversions are left to the interpreter.
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "fp8_fix", False):
        return
    widths = {tl.float32: np.float32, tl.float16: np.float16}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (*widths, tl.bfloat16):
            if input_dtype == tl.bfloat16:   # held as uint16: the top half of a float32
                wide = (input.astype(np.uint32) << 16).view(np.float32)
            else:
                wide = input.view(widths[input_dtype]).astype(np.float32)
            x = torch.from_numpy(np.ascontiguousarray(wide))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float.fp8_fix = True
    interpreter._convert_float = convert_float
