"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

TTFT is the time to the first chunk that carries text; ITL the gaps between text chunks;
TPOT (e2e - TTFT) / (output tokens - 1), with output tokens from the usage the server reports
(`stream_options.include_usage`), else the number of text chunks.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp


# A response that streamed no text (a model with random weights can print nothing printable).
NO_TEXT = "no text in the response"


@dataclass(slots=True)
class RequestRecord:
    """What one request did; times in seconds, `start` from the beginning of the run."""

    index: int
    input_len: int                      # prompt length asked for (words ≈ tokens)
    output_len: int                     # max_tokens asked for
    start: float = 0.0
    ok: bool = False
    error: str = ""
    prompt_tokens: int | None = None    # as the server counted them (usage)
    output_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    met_slo: bool = False
    response_id: str = ""               # the server's id for it (joins server-side stamps)
    engine_ttft: float | None = None    # the engine's share of the TTFT, when the server says
    cached_tokens: int | None = None    # prompt tokens served from a cache (usage's
                                        # prompt_tokens_details.cached_tokens), if reported


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to send: base URL (with /v1), model, API key, completions or chat."""

    base_url: str
    model: str
    api_key: str | None = None
    chat: bool = False

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions" if self.chat else f"{self.base_url}/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str | list[dict], max_tokens: int) -> dict:
        """A prompt is text, or for chat the whole list of messages (a multi-turn
        conversation); text for chat is one user message."""
        body = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0,
                # vLLM's extension, which OpenAI-compatible servers for benchmarks accept:
                # generate exactly max_tokens, so output lengths follow the workload.
                "ignore_eos": True}
        if self.chat:
            body["messages"] = ([{"role": "user", "content": prompt}]
                                if isinstance(prompt, str) else prompt)
        else:
            body["prompt"] = prompt
        return body


async def send(session: aiohttp.ClientSession, endpoint: Endpoint, record: RequestRecord,
               prompt: str | list[dict], t0: float, timeout: float,
               text: list[str] | None = None) -> RequestRecord:
    """Stream one request and fill `record`; errors and timeouts are recorded, not raised.
    The streamed text's pieces are appended to `text` when given (a multi-turn conversation
    sends the answer back in its next turn)."""
    record.start = time.perf_counter() - t0
    try:
        await asyncio.wait_for(_stream(session, endpoint, record, prompt, text), timeout)
        record.ok = record.ttft is not None
        if not record.ok:
            record.error = NO_TEXT
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except (aiohttp.ClientError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


async def _stream(session: aiohttp.ClientSession, endpoint: Endpoint, record: RequestRecord,
                  prompt: str | list[dict], text: list[str] | None) -> None:
    start = time.perf_counter()
    last, chunks = None, 0
    async with session.post(endpoint.url, json=endpoint.body(prompt, record.output_len),
                            headers=endpoint.headers()) as resp:
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            now = time.perf_counter()
            record.response_id = record.response_id or data.get("id") or ""
            if data.get("usage"):
                record.engine_ttft = data.get("engine_ttft_s")    # pd-cluster's extension
                record.prompt_tokens = data["usage"].get("prompt_tokens")
                record.output_tokens = data["usage"].get("completion_tokens") or 0
                details = data["usage"].get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens")
            piece = _text(data, endpoint.chat)
            if piece:
                if text is not None:
                    text.append(piece)
                chunks += 1
                if last is None:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last)
                last = now
    record.e2e = time.perf_counter() - start
    record.output_tokens = record.output_tokens or chunks
    if record.ttft is not None:
        record.tpot = ((record.e2e - record.ttft) / (record.output_tokens - 1)
                       if record.output_tokens > 1 else 0.0)


def _text(data: dict, chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""
