"""Outbox: one stream carries every request of a subscriber, in batches, with the same tokens
as per-request streams; a refused request arrives as an error message; when the subscriber
goes away its unfinished requests are aborted (KV freed); a new stream for the same
subscriber takes over from the old one."""
from __future__ import annotations

import asyncio

import pytest

from actors.engine_loop import EngineLoop
from actors.messages import StreamError
from actors.outbox import Outbox
from pd_cluster.config import EngineConfig
from pd_cluster.sampling_params import SamplingParams
from tests.support.engine_clients import wait_loop_idle
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until_async

PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [4, 4, 100, 200, 300, 12, 17, 19, 21, 3, 90], [7, 7, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def loop(tiny_model_root: str):
    cfg = EngineConfig(model=make_tiny_model("llama_gqa", tiny_model_root), block_size=4,
                       num_kv_blocks=64, max_model_len=128, max_num_seqs=8, cuda_graphs=False,
                       device="cpu")
    engine_loop = EngineLoop(cfg, stall_timeout_s=30.0)
    yield engine_loop
    engine_loop.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_one_stream_carries_all_requests_in_batches(loop: EngineLoop):
    async def go():
        alone = [[t for o in [out async for out in loop.stream(f"a{i}", p, GREEDY)]
                  for t in o.delta_token_ids] for i, p in enumerate(PROMPTS)]
        box = Outbox(on_gone=lambda ids: None)
        stream = box.stream("router")
        assert await anext(stream) == []          # subscribed
        for i, p in enumerate(PROMPTS):
            loop.submit(f"m{i}", p, GREEDY, box.queue("router", f"m{i}"))
        loop.submit("bad", list(range(500)), GREEDY, box.queue("router", "bad"))  # too long
        tokens, finished, errors, batches, deltas = {}, set(), {}, 0, 0
        while len(finished) < len(PROMPTS) or not errors:
            batch = await anext(stream)
            batches += 1
            for rid, item in batch:
                if isinstance(item, StreamError):
                    errors[rid] = item
                    continue
                deltas += 1
                tokens.setdefault(rid, []).extend(item.token_ids)
                if item.finished:
                    finished.add(rid)
        await stream.aclose()
        return alone, tokens, errors, batches, deltas

    alone, tokens, errors, batches, deltas = run(go())
    assert [tokens[f"m{i}"] for i in range(3)] == alone
    assert errors["bad"].kind == "rejected" and "bad" not in tokens
    assert batches < deltas     # several requests' steps travel in one message


def test_subscriber_gone_aborts_its_requests(tiny_model_root: str):
    # A request too long to end by itself before the abort (the module's loop is too short:
    # a request there can finish before the subscriber's first batch arrives).
    cfg = EngineConfig(model=make_tiny_model("llama_gqa", tiny_model_root), block_size=4,
                       num_kv_blocks=160, max_model_len=512, max_num_seqs=8, cuda_graphs=False,
                       device="cpu")
    loop = EngineLoop(cfg, stall_timeout_s=30.0)
    longest = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    gone: list[list[str]] = []

    def on_gone(ids: list[str]) -> None:
        gone.append(ids)
        for rid in ids:
            loop.abort(rid)

    async def go():
        box = Outbox(on_gone=on_gone)
        stream = box.stream("router")
        await anext(stream)
        mailbox = box.queue("router", "long")
        loop.submit("long", PROMPTS[1], longest, mailbox)
        first = await anext(stream)
        assert first and first[0][0] == "long"
        await stream.aclose()                      # the router replica went away
        unread: list = []

        def ended():
            while not mailbox.queue.empty():
                unread.append(mailbox.queue.get_nowait())
            return unread and unread[-1][1].finished
        await wait_until_async(ended, 10, what="the request's last output")
        await wait_loop_idle(loop)                 # every KV block is free
        return [out for rid, out in unread if rid == "long"]

    try:
        outputs = run(go())
    finally:
        loop.shutdown()
    assert gone == [["long"]]
    last = outputs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < longest.max_tokens


def test_new_stream_takes_over_the_subscriber(loop: EngineLoop):
    async def go():
        box = Outbox(on_gone=lambda ids: [loop.abort(rid) for rid in ids])
        old = box.stream("router")
        await anext(old)
        new = box.stream("router")
        await anext(new)                           # takes over; the old one ends
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(old), 5)
        loop.submit("t", PROMPTS[0], GREEDY, box.queue("router", "t"))
        got = []
        while not (got and got[-1].finished):
            got += [item for _, item in await anext(new)]
        await new.aclose()
        return sum(len(d.token_ids) for d in got)

    assert run(go()) == GREEDY.max_tokens
