"""The garbage collector's start-up freeze: what an engine's process (pd_cluster/engine.py)
and each of its tensor-parallel rank processes (pd_cluster/tp_workers.py) call once built.
Its own module so that the rank processes need nothing from the engine above them."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (the model's modules and parameters, compiled kernels,
    tokenizer tables: hundreds of thousands of them) out of the garbage collector's reach, as
    vLLM does after start-up. Otherwise each full collection walks them all while the host
    should be launching the next step: one measured on an H200 held the GPU idle for 124 ms in
    the middle of a batch-128 decode (bench/profile_decode.py `longest_gaps_ms`; none with
    the collector off), a 6 ms/step average over 20 steps and a TPOT spike when serving.
    Objects made later (requests, outputs) are still collected as usual. GPU engines only:
    a serving process holds its one engine for life, while the CPU tests build hundreds in
    one process, whose frozen cycles would never be collected."""
    gc.collect()
    gc.freeze()
