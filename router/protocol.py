"""OpenAI request bodies (the subset we serve), validated with pydantic.

No field is silently ignored. A request body may hold only
  - the fields the models declare, which we honour (or refuse by value: `echo: true`), and
  - `HARMLESS` fields, which change nothing about the output (`user`, `metadata`, ...):
    accepted and dropped;
  - `NEUTRAL` fields (sampling fields we do not implement, tools on completions) only at
    their no-op value (`length_penalty: 1`, `tools: []`);
    any other value is a 400 naming the field.
Any other key is refused with a 400 too ("Unrecognized request argument supplied"), as OpenAI
does. vLLM instead ignores unknown fields; we do not, because an unknown field is most often a
sampling or formatting option of some other server (`min_p`, `chat_template_kwargs`,
`stop_token_ids`, ...) that the client expects to change the output: answering as if it were
honoured would be a silent wrong answer, while a 400 tells the client at once.

Text must be valid Unicode: JSON may carry a lone surrogate ("\\ud800"), which no tokenizer can
encode; any such string anywhere in the body is a 400 naming where it is.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError,
                      field_validator, model_validator)

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.structured import GrammarSpec
from router.errors import APIError, ErrorCode, bad_request
from router.structured_fields import ResponseFormat, Tool, ToolChoice, output_grammar
from router.tool_calls import ToolMode, ToolPlan, with_parsed_arguments

MAX_N = 16            # choices per request: each is one engine request
MAX_STOP_STRINGS = 4  # as OpenAI
SEED_BOUND = 1 << 63  # the engine seeds a torch.Generator with seed + choice index
MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI
_TOKEN_ID = re.compile(r"[0-9]{1,20}")

# Accepted on both endpoints and dropped: they change nothing about the output.
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                      "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                      "request_id"})


def _is_empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _is_none(v: Any) -> bool:
    return v is None


# Fields we do not implement, accepted only at the value that changes nothing: field →
# (is the value a no-op?, what the no-op values are, for the message).
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_is_empty, "absent or empty; tool calls are on /v1/chat/completions only"),
    "tool_choice": (lambda v: v is None or v == "none",
                    'absent or "none"; tool calls are on /v1/chat/completions only'),
    "functions": (_is_empty, "absent or empty; function calls are not supported"),
    "function_call": (lambda v: v is None or v == "none",
                      'absent or "none"; function calls are not supported'),
    "parallel_tool_calls": (_is_none, "absent; tool calls are on /v1/chat/completions only"),
    "length_penalty": (lambda v: v is None or (isinstance(v, (int, float))
                                               and not isinstance(v, bool) and v == 1),
                       "1; beam search is not supported"),
    "best_of": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                        and v == 1), "1; best_of is not supported"),
    "use_beam_search": (lambda v: v is None or v is False, "false; beam search is not supported"),
    "suffix": (lambda v: v is None or v == "", "absent; suffix (insertion) is not supported"),
    "audio": (_is_none, "absent; audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"],
                   'absent or ["text"]; only text output is supported'),
    "prediction": (_is_none, "absent; predicted outputs are not supported"),
    "reasoning_effort": (_is_none, "absent; reasoning effort is not supported"),
    "web_search_options": (_is_none, "absent; web search is not supported"),
    "verbosity": (_is_none, "absent; verbosity is not supported"),
    "moderation": (_is_none, "absent; moderation is not supported"),
    "guided_grammar": (_is_none, "absent; grammars other than guided_json, guided_regex and "
                                "guided_choice are not supported"),
    "guided_decoding_backend": (_is_none, "absent; guided decoding is not supported"),
    "guided_whitespace_pattern": (_is_none, "absent; guided decoding is not supported"),
    "structured_outputs": (_is_none, "absent; structured output is not supported"),
}


def check_unicode(body: Any) -> None:
    """400 for the first string (value or key) in the body that UTF-8 cannot encode (a lone
    surrogate), with its path as `param`. Iterative: the body may be deeply nested."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path + (key,))
                stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (i,)) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = ".".join(str(p).encode("utf-8", "backslashreplace").decode() for p in path)
        raise bad_request(f"{param or 'body'}: the text is not valid Unicode (a lone surrogate "
                          f"at character {e.start}); send UTF-8 text", param=param or None,
                          code=ErrorCode.INVALID_VALUE) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's; usage rides only the last chunk here
    include_obfuscation: bool = False      # OpenAI's padding of stream events: not sent here

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, value: bool) -> bool:
        if value:
            raise ValueError("continuous usage stats are not supported")
        return value

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        if value:
            raise ValueError("stream obfuscation is not supported; send false")
        return value


class _Common(BaseModel):
    """Sampling fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")   # _refuse_unhonoured drops or refuses first

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-SEED_BOUND, lt=SEED_BOUND - MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, which load generators (ignore_eos) and clients of vLLM rely on.
    top_k: int = Field(0, ge=-1, lt=1 << 31)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # Penalties (null: off). repetition_penalty is vLLM's (and HF's) extension.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] \
        | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: the prompt's cached KV is shared only with requests of the same salt (and tenant).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Structured output (router/structured_fields.py): OpenAI's and vLLM's.
    response_format: ResponseFormat | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    _grammar: GrammarSpec | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _output_grammar(self) -> Any:
        self._grammar = output_grammar(self.response_format, self.guided_json,
                                       self.guided_regex, self.guided_choice)
        return self

    @model_validator(mode="before")
    @classmethod
    def _refuse_unhonoured(cls, data: Any) -> Any:
        """Drop HARMLESS fields and NEUTRAL ones at their no-op value; refuse every other
        field the model does not declare (see the module docstring)."""
        if not isinstance(data, dict):
            return data
        kept = {}
        for key, value in data.items():
            if key in cls.model_fields:
                kept[key] = value
            elif key in NEUTRAL:
                neutral, expected = NEUTRAL[key]
                if not neutral(value):
                    raise APIError(400, f"{key}: must be {expected}.", param=key,
                                   code=ErrorCode.UNSUPPORTED_VALUE)
            elif key not in HARMLESS:
                raise APIError(400, f"Unrecognized request argument supplied: {key}",
                               param=str(key), code=ErrorCode.UNKNOWN_PARAMETER)
        return kept

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids (decimal digits), got {key[:40]!r}")
        return value

    def check_token_ids(self, vocab_size: int) -> None:
        """400 naming `logit_bias` when it biases a token the tokenizer does not have."""
        bad = [k for k in self.logit_bias or {} if int(k) >= vocab_size]
        if bad:
            raise bad_request(f"logit_bias: token ids must be in [0, {vocab_size}), got "
                              f"{bad[0][:40]}", param="logit_bias", code=ErrorCode.INVALID_VALUE)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int,
                        tenant_salt: str | None = None) -> SamplingParams:
        """Engine parameters of choice `index` (seeded choices differ by their index); the
        cache salt is the tenant's and the request's together."""
        if self._grammar is not None and self.min_tokens:
            raise APIError(400, "min_tokens: must be 0 with structured output or a required "
                           "tool call (it would ban the end the grammar needs).",
                           param="min_tokens", code=ErrorCode.UNSUPPORTED_VALUE)
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=seed, stop=list(self.stop or []),
                              max_tokens=max_tokens, min_tokens=self.min_tokens,
                              ignore_eos=self.ignore_eos, logprobs=logprobs,
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=self.repetition_penalty or 1.0,
                              logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                              grammar=self._grammar,
                              cache_salt=_salt(tenant_salt, self.cache_salt))


def _salt(tenant: str | None, request: str | None) -> str | None:
    # The tenant's part first and length-prefixed, so no request salt can reproduce another
    # tenant's.
    if tenant is None:
        return request
    return f"{len(tenant)}:{tenant}:{request or ''}"


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise APIError(400, "echo: must be false; echo is not supported.", param="echo",
                           code=ErrorCode.UNSUPPORTED_VALUE)
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt: must not be empty", param="prompt",
                              code=ErrorCode.INVALID_VALUE)
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, a list of strings, token ids, lists of ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_call_id... go to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: str | list[dict[str, Any]] | None) -> Any:
        for part in value if isinstance(value, list) else []:
            if part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string `text`")
        return value

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (content parts joined into text)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part["text"] for part in self.content)
        return with_parsed_arguments(msg)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool calls (router/tool_calls.py); several calls in one turn are allowed, not refusable.
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _tool_plan: ToolPlan = PrivateAttr(ToolPlan(ToolMode.NONE))

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs",
                              code=ErrorCode.INVALID_VALUE)
        if self.parallel_tool_calls is False:
            raise APIError(400, "parallel_tool_calls: must be true or absent; limiting a turn "
                           "to one tool call is not supported.", param="parallel_tool_calls",
                           code=ErrorCode.UNSUPPORTED_VALUE)
        self._tool_plan = ToolPlan.of(self.tools, self.tool_choice)
        grammar = self._tool_plan.grammar()
        if grammar is not None:
            if self._grammar is not None:
                raise bad_request("tool_choice: a required or named tool cannot be combined "
                                  "with another output constraint", param="tool_choice",
                                  code=ErrorCode.INVALID_VALUE)
            self._grammar = grammar
        return self

    @property
    def tool_plan(self) -> ToolPlan:
        return self._tool_plan

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; a pydantic error becomes a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    check_unicode(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param or 'body'}: {err['msg']}", param=param,
                       code=ErrorCode.INVALID_VALUE) from None
