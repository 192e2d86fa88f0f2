"""What the engine reports per step: typed, and cheap to send between processes."""
from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.request import FinishReason


@dataclass(slots=True)
class CompletionOutput:
    """One completion so far. While unfinished, `token_ids` and `logprobs` are the engine's
    live lists (no copy per step): copy them to keep a snapshot across steps."""

    index: int
    text: str = ""                                       # everything generated so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None                 # the stop token id or stop string hit


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    delta_text: str = ""                                 # new text since the previous output
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # Seconds from the request's arrival in this engine to its first token's output: the
    # engine's share of the TTFT (queue and prefill), the rest being the serving path's.
    engine_ttft: float | None = None
    # Speculative decoding (pd_cluster/spec_decode/): draft tokens verified, and kept.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # A finished output's (arrival, first scheduled, first token, now, grammar matcher built)
    # monotonic stamps in this engine (None where not yet or not at all): the engine's stages
    # of a request trace (router/tracing.py).
    engine_times: tuple[float, float | None, float | None, float, float | None] | None = None
