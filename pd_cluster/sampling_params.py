"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pd_cluster.structured.spec import GrammarSpec

_GREEDY_EPS = 1e-5


def _within(value: object, low: float, high: float) -> bool:
    """A finite real number (not a bool) in [low, high]."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and low <= value <= high)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop; field names follow vLLM and OpenAI.

    `temperature=0` is greedy. `top_k=0` (or -1), `top_p=1` and `min_p=0` disable those filters.
    `logprobs=n` returns the sampled token's log-probability and the top n alternatives.
    `presence_penalty` and `frequency_penalty` (OpenAI's, over output tokens), `repetition_penalty`
    (HF's, over prompt and output tokens; 1 is off) and `logit_bias` (token id -> bias added to
    its logit) change the logits before sampling, greedy included (pd_cluster/penalties.py).
    `grammar` constrains every sampled token to keep the output a prefix of the grammar's
    language; the request stops (finish reason "stop") when the grammar ends.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: GrammarSpec | None = None     # the output must match it (pd_cluster/structured)
    # Salts the prompt's KV block hashes: prompts with different salts never share cached KV
    # (vLLM's cache_salt; the router puts a tenant's salt here, router/tenants.py).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be -1, 0 or positive"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             "must be an integer >= 1"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens,
             "must be an integer >= 0"),
            ("min_tokens", self.min_tokens <= self.max_tokens, "must not exceed max_tokens"),
            ("min_tokens", self.grammar is None or self.min_tokens == 0,
             "must be 0 with a grammar (it would ban the end the grammar needs)"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int)
                                                  and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative integers"),
            ("presence_penalty", _within(self.presence_penalty, -2, 2), "must be in [-2, 2]"),
            ("frequency_penalty", _within(self.frequency_penalty, -2, 2), "must be in [-2, 2]"),
            ("repetition_penalty", _within(self.repetition_penalty, 0, math.inf)
             and self.repetition_penalty > 0, "must be a finite number > 0"),
            ("logit_bias", all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                               and _within(b, -100, 100) for t, b in self.logit_bias.items()),
             "must map non-negative integer token ids to biases in [-100, 100]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

    @property
    def penalized(self) -> bool:
        """A bias or a penalty changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1
