"""OpenAI response bodies: completions and chat, whole or as SSE chunks, with logprobs.

A Formatter turns what the engine reports about one choice (new text, new tokens with their
logprob dicts, the finish reason) into the endpoint's JSON shape; the serving code is the
same for both endpoints.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.request import FinishReason
from pd_cluster.tokenizer import Tokenizer

Logprobs = Sequence[dict[int, float]]   # per token: {token id: logprob}, the sampled one included
# What OpenAI reports for a token too unlikely to have a logprob (JSON has no -inf).
_UNKNOWN_LOGPROB = -9999.0


@dataclass(slots=True)
class Choice:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; `[DONE]` is sent as is."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          spec_proposed: int = 0, spec_accepted: int = 0) -> dict[str, Any]:
    """OpenAI's usage; beside it, when the engine speculated, `spec_decode`: draft tokens
    verified and kept for this request (README, "Speculative decoding")."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if spec_proposed:
        out["spec_decode"] = {"proposed_tokens": spec_proposed,
                              "accepted_tokens": spec_accepted}
    return out


class Formatter(ABC):
    """The JSON of one endpoint; `top_logprobs` is None when logprobs were not asked for."""

    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer,
                 top_logprobs: int | None) -> None:
        self.request_id, self.model, self.tokenizer = request_id, model, tokenizer
        self.top_logprobs = top_logprobs
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def response(self, choices: Sequence[Choice], usage_: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.object_name, [self.whole_choice(c) for c in choices])
        return {**body, "usage": usage_}

    def chunk(self, index: int, text: str, token_ids: Sequence[int], logprobs: Logprobs,
              finish_reason: FinishReason | None) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name,
                              [self.delta_choice(index, text, token_ids, logprobs,
                                                 finish_reason)])

    def usage_chunk(self, usage_: dict[str, Any],
                    engine_ttft: float | None = None) -> dict[str, Any]:
        """The last chunk (stream_options.include_usage). Beside OpenAI's fields it names the
        engine's share of the TTFT, `engine_ttft_s` (arrival in the engine that made the
        first token to that token), so that a client can tell the serving path's share:
        `pd-cluster profile-serving` measures it under load this way."""
        chunk = {**self._envelope(self.chunk_object_name, []), "usage": usage_}
        if engine_ttft is not None:
            chunk["engine_ttft_s"] = round(engine_ttft, 6)
        return chunk

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks sent before any text (chat announces the assistant role)."""
        return []

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @abstractmethod
    def whole_choice(self, choice: Choice) -> dict[str, Any]: ...

    @abstractmethod
    def delta_choice(self, index: int, text: str, token_ids: Sequence[int], logprobs: Logprobs,
                     finish_reason: FinishReason | None) -> dict[str, Any]: ...


class CompletionFormatter(Formatter):
    """/v1/completions: `logprobs` in the legacy tokens/token_logprobs/top_logprobs shape."""

    object_name = chunk_object_name = "text_completion"

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "text": choice.text,
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": choice.finish_reason}

    def delta_choice(self, index: int, text: str, token_ids: Sequence[int], logprobs: Logprobs,
                     finish_reason: FinishReason | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(token_ids, logprobs),
                "finish_reason": finish_reason}

    def _logprobs(self, token_ids: Sequence[int], logprobs: Logprobs) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens,
                "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [{self.token_text(t): v for t, v in _top(lp, self.top_logprobs)}
                                 for lp in logprobs],
                "text_offset": offsets}


class ChatFormatter(Formatter):
    """/v1/chat/completions: messages and deltas, `logprobs.content` entries."""

    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [self._envelope(self.chunk_object_name,
                               [{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}])
                for i in range(num_choices)]

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": choice.finish_reason}

    def delta_choice(self, index: int, text: str, token_ids: Sequence[int], logprobs: Logprobs,
                     finish_reason: FinishReason | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(token_ids, logprobs), "finish_reason": finish_reason}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, token_ids: Sequence[int], logprobs: Logprobs) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [{**self._entry(t, lp.get(t, _UNKNOWN_LOGPROB)),
                             "top_logprobs": [self._entry(a, v)
                                              for a, v in _top(lp, self.top_logprobs)]}
                            for t, lp in zip(token_ids, logprobs)]}


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely entries, most likely first."""
    return sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]
