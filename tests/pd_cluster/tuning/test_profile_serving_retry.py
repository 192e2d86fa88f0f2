"""profile-serving times lone requests by their first text; a model with random weights can
stream none in a few tokens. Such a response is sent again with a fresh prompt (a few times),
against a stub OpenAI endpoint here (aiohttp) that prints nothing to its first two requests."""
from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from pd_cluster.benchmark.client import NO_TEXT, Endpoint
from pd_cluster.tuning import serving


pytestmark = pytest.mark.serve      # a stub HTTP server on a loopback port


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": text}]}) + "\n\n"


async def _with_stub(empty_answers: int, body) -> None:
    calls = {"n": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        calls["n"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("" if calls["n"] <= empty_answers else "hi").encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await body(Endpoint(f"http://127.0.0.1:{port}/v1", "m"), calls)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("empty_answers, ok", [(2, True), (serving.TEXT_RETRIES, False)])
def test_a_response_without_text_is_sent_again(empty_answers: int, ok: bool):
    async def body(endpoint: Endpoint, calls: dict) -> None:
        async with aiohttp.ClientSession() as session:
            rng = np.random.default_rng(0)
            if ok:
                record = await serving._timed(session, endpoint, 0, 8, rng, 10.0)
                assert record.ok and record.ttft is not None and not record.error
                assert calls["n"] == empty_answers + 1
            else:
                with pytest.raises(ValueError, match=NO_TEXT):
                    await serving._timed(session, endpoint, 0, 8, rng, 10.0)
                assert calls["n"] == serving.TEXT_RETRIES

    asyncio.run(_with_stub(empty_answers, body))
