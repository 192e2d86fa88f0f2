"""Tool calls on /v1/chat/completions: what `tools` / `tool_choice` ask of the output, and
the assistant's tool calls read back from the text the model wrote.

- `none`: the tools are not shown to the model; plain text comes back.
- a named function: the output is constrained to that function's arguments (its `parameters`
  JSON schema), and comes back as one call of it (finish reason "stop", as OpenAI's).
- `required`: the output is constrained to a JSON array of one or more
  `{"name": <a tool>, "parameters": <its arguments>}`, read back as those calls.
- `auto`: unconstrained; the model's own format is parsed: Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2/Qwen3), or a reply that is a
  JSON object `{"name": ..., "parameters": ...}` (Llama 3.1; its `<|python_tag|>` is a special
  token the detokenizer drops), several separated by ";". Text outside the calls is content.

Streamed, content goes out as it comes (held back only while it may be the start of a call);
each call goes out as one `tool_calls` delta (id, name, whole arguments) once it is complete.
"""
from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.request import FinishReason
from pd_cluster.structured import GrammarSpec
from router.errors import ErrorCode, bad_request
from router.responses import ChatFormatter, Choice, Logprobs
from router.structured_fields import NamedToolChoice, Tool, schema_grammar

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class ToolMode(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's `tools` and `tool_choice` ask for."""

    mode: ToolMode
    tools: tuple[Tool, ...] = ()
    name: str | None = None          # NAMED: the function

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> ToolPlan:
        tools = tuple(tools or ())
        if choice is None:
            choice = "auto" if tools else "none"
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in "
                                  f"tools ({', '.join(names) or 'none given'})",
                                  param="tool_choice", code=ErrorCode.INVALID_VALUE)
            return cls(ToolMode.NAMED, tools, choice.function.name)
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice: {choice!r} needs tools", param="tool_choice",
                              code=ErrorCode.INVALID_VALUE)
        return cls(ToolMode(choice), tools)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them (none for `none`)."""
        if self.mode is ToolMode.NONE:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def grammar(self) -> GrammarSpec | None:
        """The constraint `required` and a named function put on the output."""
        if self.mode is ToolMode.NAMED:
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return schema_grammar(fn.schema, "tools.function.parameters")
        if self.mode is ToolMode.REQUIRED:
            calls = [{"type": "object", "additionalProperties": False,
                      "required": ["name", "parameters"],
                      "properties": {"name": {"const": t.function.name},
                                     "parameters": t.function.schema}} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return schema_grammar(schema, "tools.function.parameters")
        return None


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                   # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.message()}


def _call(obj: Any) -> ToolCall | None:
    """A call from a parsed {"name": ..., "parameters" | "arguments": {...}}, else None."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) \
        if isinstance(args, dict) else None


def _json_calls(text: str) -> list[ToolCall] | None:
    """Llama 3.1: the whole reply is one call's JSON, or several separated by ";"."""
    calls = []
    for part in text.strip().split(";"):
        if not part.strip():
            continue
        try:
            call = _call(json.loads(part))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _tagged_call(body: str) -> ToolCall | None:
    try:
        return _call(json.loads(body))
    except ValueError:
        return None


def parse_auto(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply under `auto`."""
    streamer = AutoStreamer()
    content, calls = streamer.feed(text)
    rest, more = streamer.finish()
    return content + rest, calls + more


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a reply constrained by `ToolPlan.grammar` under `required`."""
    try:
        items = json.loads(text)
    except ValueError:
        return []       # cut short by max_tokens: no complete call
    return [c for c in map(_call, items if isinstance(items, list) else []) if c]


class AutoStreamer:
    """Splits a streamed `auto` reply into content deltas and complete calls."""

    def __init__(self) -> None:
        self._held = ""          # text not yet judged
        self._json = None        # True: the reply is a JSON call (Llama); None: not known yet
        self._in_tag = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        if self._json is None:
            start = self._held.lstrip()
            if not start:
                return "", []
            self._json = start.startswith("{")
        if self._json:
            return "", []        # judged whole at the end
        return self._tags()

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._json:
            calls = _json_calls(held)
            return ("", calls) if calls else (held, [])
        if self._in_tag:
            call = _tagged_call(held)     # an unclosed last call
            return ("", [call]) if call else (_OPEN + held, [])
        return held, []

    def _tags(self) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            if self._in_tag:
                end = self._held.find(_CLOSE)
                if end < 0:
                    return content, calls
                body, self._held = self._held[:end], self._held[end + len(_CLOSE):]
                self._in_tag = False
                call = _tagged_call(body)
                if call:
                    calls.append(call)
                else:
                    content += _OPEN + body + _CLOSE
                continue
            start = self._held.find(_OPEN)
            if start >= 0:
                content += self._held[:start]
                self._held = self._held[start + len(_OPEN):]
                self._in_tag = True
                continue
            keep = _partial_suffix(self._held, _OPEN)
            content += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier tool calls with their JSON-text arguments parsed:
    chat templates (Llama 3.1's, Qwen's) render `arguments` as a mapping."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except ValueError:
                pass
        parsed.append(call)
    return {**message, "tool_calls": parsed}


class ToolCallFormatter(ChatFormatter):
    """Chat responses whose assistant turn may be tool calls (a ToolPlan other than none)."""

    def __init__(self, request_id: str, model: str, tokenizer: Any,
                 top_logprobs: int | None, plan: ToolPlan) -> None:
        super().__init__(request_id, model, tokenizer, top_logprobs)
        self.plan = plan
        self._streams: dict[int, _ChoiceStream] = {}

    def _calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.plan.mode is ToolMode.NAMED:
            return None, [ToolCall(self.plan.name, text)]
        if self.plan.mode is ToolMode.REQUIRED:
            return None, parse_required(text)
        content, calls = parse_auto(text)
        return content, calls

    def _reason(self, reason: FinishReason | None, called: bool) -> Any:
        if called and reason is FinishReason.STOP and self.plan.mode is not ToolMode.NAMED:
            return "tool_calls"
        return reason

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        body = super().whole_choice(choice)
        content, calls = self._calls(choice.text)
        body["message"] = {"role": "assistant", "content": content or None}
        if calls:
            body["message"]["tool_calls"] = [c.message() for c in calls]
        body["finish_reason"] = self._reason(choice.finish_reason, bool(calls))
        return body

    def delta_choice(self, index: int, text: str, token_ids: Sequence[int], logprobs: Logprobs,
                     finish_reason: FinishReason | None) -> dict[str, Any]:
        body = super().delta_choice(index, text, token_ids, logprobs, finish_reason)
        stream = self._streams.setdefault(index, _ChoiceStream(self.plan))
        content, deltas = stream.feed(text, finished=finish_reason is not None)
        body["delta"] = {}
        if content:
            body["delta"]["content"] = content
        if deltas:
            body["delta"]["tool_calls"] = deltas
        body["finish_reason"] = self._reason(finish_reason, stream.called)
        return body


class _ChoiceStream:
    """One choice's streamed deltas under a ToolPlan."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.called = plan, False
        self._auto = AutoStreamer()
        self._buffer = ""
        self._named: ToolCall | None = None
        self._count = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.plan.mode is ToolMode.NAMED:
            return "", self._named_delta(text)
        if self.plan.mode is ToolMode.REQUIRED:
            self._buffer += text
            return "", self._deltas(parse_required(self._buffer)) if finished else []
        content, calls = self._auto.feed(text)
        if finished:
            rest, more = self._auto.finish()
            content, calls = content + rest, calls + more
        return content, self._deltas(calls)

    def _named_delta(self, text: str) -> list[dict[str, Any]]:
        """The named call streams its arguments as they come (OpenAI's shape)."""
        if self._named is None:
            self._named, self.called = ToolCall(self.plan.name, text), True
            return [self._named.delta(0)]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = [c.delta(self._count + i) for i, c in enumerate(calls)]
        self._count += len(calls)
        self.called = self.called or bool(calls)
        return out
