"""OpenAI request bodies (the subset we serve), validated with pydantic.

Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send `user`,
`presence_penalty` and the like keep working; fields we cannot honour are refused instead.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from pd_cluster.sampling_params import SamplingParams
from router.errors import APIError, ErrorCode, bad_request

MAX_N = 16            # choices per request: each is one engine request
MAX_STOP_STRINGS = 4  # as OpenAI


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Sampling fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, which load generators (ignore_eos) and clients of vLLM rely on.
    top_k: int = Field(0, ge=-1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        """Engine parameters of choice `index` (seeded choices differ by their index)."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=seed, stop=list(self.stop or []), max_tokens=max_tokens,
                              min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                              logprobs=logprobs)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
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

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (content parts joined into text)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise bad_request("only text content parts are supported", param="messages")
            msg["content"] = "".join(str(part.get("text", "")) for part in self.content)
        return msg


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; a pydantic error becomes a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param or 'body'}: {err['msg']}", param=param,
                       code=ErrorCode.INVALID_VALUE) from None
