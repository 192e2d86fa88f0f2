"""Test support: make an engine's step launches fail on any host-device synchronization."""
from __future__ import annotations

import torch


def strict_launches(engine) -> list:
    """Wrap `engine.runner.execute` so that a launch that waits for the device raises (CUDA
    sync debug mode "error"); returns the list the launched steps are appended to."""
    execute, launches = engine.runner.execute, []

    def strict_execute(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launches.append(execute(*args, **kwargs))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return launches[-1]

    engine.runner.execute = strict_execute
    return launches
