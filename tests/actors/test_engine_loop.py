"""EngineLoop: concurrent streams match the engine run alone; a consumer that stops early, is
cancelled or is aborted frees its KV; a refused request raises and the loop keeps serving."""
from __future__ import annotations

import asyncio
import time

import pytest

from actors.engine_loop import EngineLoop, RequestRejected
from pd_cluster.config import EngineConfig
from pd_cluster.engine import LLMEngine
from pd_cluster.sampling_params import SamplingParams
from tests.support.engine_clients import wait_loop_idle
from tests.support.tiny_models import make_tiny_model

PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [4, 4, 100, 200, 300, 12, 17, 19, 21, 3, 90]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tiny_model_root: str) -> EngineConfig:
    return EngineConfig(model=make_tiny_model("llama_gqa", tiny_model_root), block_size=4,
                        num_kv_blocks=24, max_model_len=128, max_num_seqs=8, cuda_graphs=False,
                        device="cpu")


@pytest.fixture(scope="module")
def loop(config: EngineConfig):
    engine_loop = EngineLoop(config, stall_timeout_s=30.0)
    yield engine_loop
    engine_loop.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def collect(loop: EngineLoop, request_id: str, prompt: list[int],
                  params: SamplingParams = GREEDY):
    return [out async for out in loop.stream(request_id, prompt, params)]


def test_concurrent_streams_match_the_engine_alone(loop: EngineLoop, config: EngineConfig):
    async def both():
        return await asyncio.gather(*[collect(loop, f"c{i}", p) for i, p in enumerate(PROMPTS)])

    streams = run(both())
    engine = LLMEngine(config)
    for prompt, outs in zip(PROMPTS, streams, strict=True):
        engine.add_request(prompt, GREEDY, "ref")
        ref = None
        while engine.has_unfinished():
            ref = next((o for o in engine.step() if o.finished), ref)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(outs[-1].outputs[0].token_ids) == GREEDY.max_tokens
    assert run(wait_loop_idle(loop)).kv_blocks_total == 24


def test_consumer_that_stops_early_aborts_and_frees_kv(loop: EngineLoop):
    async def stop_after_two():
        stream = loop.stream("early", PROMPTS[0], GREEDY)
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return got, await wait_loop_idle(loop)

    got, _ = run(stop_after_two())
    assert not got[-1].finished


def test_cancelled_consumer_aborts_and_frees_kv(loop: EngineLoop):
    async def cancel_mid_stream():
        long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        started = asyncio.Event()

        async def consume():
            async for _ in loop.stream("cancelled", PROMPTS[1], long):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()               # right after the first output: 79 tokens still to go
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_loop_idle(loop)

    run(cancel_mid_stream())


def test_abort_ends_the_stream_with_reason_abort(loop: EngineLoop):
    async def abort_mid_stream():
        long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        outs = []
        async for out in loop.stream("aborted", PROMPTS[0], long):
            outs.append(out)
            if len(outs) == 2:
                loop.abort("aborted")
        return outs, await wait_loop_idle(loop)

    outs, _ = run(abort_mid_stream())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 80


def test_refused_request_raises_and_the_loop_keeps_serving(loop: EngineLoop):
    with pytest.raises(RequestRejected, match="max_model_len"):
        run(collect(loop, "too-long", list(range(1, 200))))
    with pytest.raises(RequestRejected, match="KV blocks"):   # 24 blocks of 4 < 7 + 100
        run(collect(loop, "too-big", PROMPTS[0],
                    SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)))
    assert run(collect(loop, "after", PROMPTS[0]))[-1].finished


def test_duplicate_request_id_is_refused(loop: EngineLoop):
    async def twice():
        first = loop.stream("dup", PROMPTS[0], GREEDY)
        await anext(first)
        with pytest.raises(RequestRejected, match="already in use"):
            await anext(loop.stream("dup", PROMPTS[0], GREEDY))
        await first.aclose()
        await wait_loop_idle(loop)

    run(twice())


def test_slow_consumer_gets_coalesced_outputs_with_all_deltas(loop: EngineLoop):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def slow():
        outs = []
        async for out in loop.stream("slow", PROMPTS[0], params):
            outs.append(out)
            # The behaviour under test: a consumer slower than the engine's steps (a few
            # ms each), whose outputs the loop folds together while it is away.
            await asyncio.sleep(0.05)
        return outs
    outs = run(slow())
    final = outs[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 40
    assert len(outs) < 40                           # several steps folded into one output
    assert sum((o.delta_token_ids for o in outs), []) == final.outputs[0].token_ids


def test_outputs_name_the_engines_share_of_the_ttft(loop: EngineLoop, config: EngineConfig):
    """From the request reaching the loop (a wait for the step in progress included) to its
    first token's output; every later output repeats it."""
    async def go():
        t0, outs = time.monotonic(), []
        async for out in loop.stream("ttft", PROMPTS[0], GREEDY):
            outs.append((out, time.monotonic()))
        return t0, outs
    t0, outs = run(go())
    (first, seen), *rest = outs
    assert 0 < first.engine_ttft <= seen - t0
    assert all(out.engine_ttft == first.engine_ttft for out, _ in rest)
    engine = LLMEngine(config)       # an arrival earlier than the add counts from the arrival
    engine.add_request(PROMPTS[1], GREEDY, "early", arrival_time=time.monotonic() - 5.0)
    out = engine.step()[0]
    assert out.engine_ttft >= 5.0
