"""Driving the router's engine clients (DisaggregatedClient, pooled or not) and engine loops
from a test, and reading what their engines did from the loads they report."""
from __future__ import annotations

from typing import Any

from actors.messages import ReplicaLoad
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams
from router.routing import Route
from tests.support.waiting import wait_until_async


async def collect(client: Any, rid: str, prompt: list[int], params: SamplingParams, route: Route,
                  on_output=None) -> RequestOutput:
    """The request's last output; `on_output(out)` (async) is awaited after each one."""
    final = None
    async for out in client.generate(rid, prompt, params, route):
        final = out
        if on_output is not None:
            await on_output(out)
    return final


def prefilled_tokens(load: ReplicaLoad) -> int:
    """Prompt tokens an engine actor has computed itself (its prefill and mixed steps' chunks),
    from its load report (`actor.load()`, EngineLoop.load)."""
    steps = load.steps
    return steps["prefill"]["sum_tokens"] + steps["mixed"]["sum_tokens"]


def prefilling(load: ReplicaLoad) -> bool:
    """The engine has run a prefill step and still runs a request: mid-prefill of a prompt
    longer than one step's token budget, when it was idle before."""
    return load.steps["prefill"]["steps"] >= 1 and load.num_running > 0


def idle(load: ReplicaLoad) -> bool:
    return load.num_running == load.num_waiting == load.kv_blocks_used == 0


async def wait_loop_idle(loop: Any, timeout_s: float = 10.0) -> ReplicaLoad:
    """An EngineLoop's load once nothing runs, waits or holds a block (the engine thread
    refreshes it after each step)."""
    try:
        return await wait_until_async(lambda: idle(loop.load()) and loop.load(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"engine did not go idle: {loop.load()}") from None
