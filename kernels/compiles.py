"""A log of Triton kernel compilations in this process, for diagnosing stalls.

A Triton kernel compiles (about a second, GIL held for much of it) the first time it meets a
new specialization: a constexpr value, an integer argument that is newly 1 or a multiple of
16, a pointer of new alignment. Mid-serving that is a one-second step and a queue behind it.
The engine warms the variants it uses before serving (`LLMEngine.warm_up`); this log shows
whether any compile happened after that.
"""
from __future__ import annotations

import collections
import time

# (monotonic time, kernel name) of recent compilations (or loads from Triton's disk cache).
LOG: collections.deque[tuple[float, str]] = collections.deque(maxlen=256)
_installed = False


def watch() -> None:
    """Record every compilation from now on (idempotent; keeps any hook already set)."""
    global _installed
    if _installed:
        return
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        LOG.append((time.monotonic(), kwargs["fn"].name))
        # A truthy return would tell Triton to skip the compile: pass the previous hook's on.
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = hook
    _installed = True


def since(t: float) -> list[tuple[float, str]]:
    """Compilations logged at or after monotonic time `t`."""
    return [entry for entry in LOG if entry[0] >= t]
