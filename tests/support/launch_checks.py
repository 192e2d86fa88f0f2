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


def assert_mixed_prompts_never_wait(engine, params) -> None:
    """The mixed prompts (tiny_models.mixed_prompts) run to the end with every step launched
    without a host sync (more than 24 launches), and every KV block free afterwards."""
    from tests.support.tiny_models import mixed_prompts

    launches = strict_launches(engine)
    for p in mixed_prompts():
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
    assert len(launches) > 24 and engine.kv.num_free_blocks == engine.kv.num_blocks
