"""A request's tokens, KV blocks and status, with the only legal status transitions."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.sampling_params import SamplingParams


# Async scheduling: a token sampled by a step still running on the device. It is the request's
# last output token from the step's launch until the engine records the step's results.
PENDING_TOKEN = -1


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are OpenAI's `finish_reason` strings (str-valued, so
    they compare equal to and serialize as those strings)."""

    STOP = "stop"        # a stop token, EOS or a stop string
    LENGTH = "length"    # max_tokens reached
    ABORT = "abort"      # cancelled by the client or the system
    ERROR = "error"      # ended by an engine error

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = "waiting"                # queued for (re)computation of its prompt
    PREFILLING = "prefilling"          # some, not all, prompt chunks computed
    TRANSFERRING = "transferring"      # prefill side: KV being pushed to a decode engine
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, KV not yet arrived
    RUNNING = "running"                # decoding, one token per step
    FINISHED = "finished"              # ended normally; finish_reason says why
    ABORTED = "aborted"                # cancelled by the client or the system
    FAILED = "failed"                  # ended by an error; error says which

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


_S = RequestStatus
_END = {_S.FINISHED, _S.ABORTED, _S.FAILED}
# Preemption returns a request to WAITING from any computing state (recompute from scratch).
TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    _S.WAITING: {_S.PREFILLING, _S.RUNNING, _S.WAITING_FOR_KV} | _END,
    _S.PREFILLING: {_S.PREFILLING, _S.RUNNING, _S.TRANSFERRING, _S.WAITING} | _END,
    _S.TRANSFERRING: _END,
    _S.WAITING_FOR_KV: {_S.RUNNING, _S.WAITING} | _END,
    _S.RUNNING: {_S.WAITING, _S.TRANSFERRING} | _END,
    _S.FINISHED: set(), _S.ABORTED: set(), _S.FAILED: set(),
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: prompt + generated tokens, and how far its KV has been computed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None   # monotonic, when its first token was output
    scheduled_time: float | None = None     # monotonic, when first scheduled: its queue's end
    grammar_time: float | None = None       # monotonic, when its grammar's matcher was built
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0     # tokens whose KV is in this engine's blocks
    num_cached_tokens: int = -1      # prefix-cache hit at first scheduling (-1: not yet)
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Prefill side of a disaggregated request: after its first token, keep its KV blocks
    # (status TRANSFERRING) until the engine is told the transfer is over.
    hold_kv: bool = False
    # Speculative decoding (pd_cluster/spec_decode/): draft tokens verified, and kept.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # A grammar-constrained request's matcher (pd_cluster/structured), built at admission.
    grammar_state: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (hot in every step)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def move_to(self, status: RequestStatus) -> None:
        if status not in TRANSITIONS[self.status]:
            raise RuntimeError(f"request {self.request_id}: illegal transition "
                               f"{self.status.name} -> {status.name}")
        self.status = status

    def finish(self, status: RequestStatus, reason: FinishReason,
               stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.move_to(status)
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error

    def append_token(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def append_pending(self) -> None:
        self.output_token_ids.append(PENDING_TOKEN)

    def fill_pending(self, token_id: int, logprobs: dict[int, float] | None) -> None:
        self.output_token_ids[-1] = token_id
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def drop_pending(self) -> None:
        """Forget a token still on the device (the request ended before it was recorded)."""
        if self.output_token_ids and self.output_token_ids[-1] == PENDING_TOKEN:
            self.output_token_ids.pop()

    def check_stop(self) -> bool:
        """Finish on a stop token, EOS or the length limit; True if the request just ended."""
        params, token = self.params, self.output_token_ids[-1]
        n = len(self.output_token_ids)
        if n >= params.min_tokens:
            if token in params.stop_token_ids:
                self.finish(RequestStatus.FINISHED, FinishReason.STOP, stop_reason=token)
                return True
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish(RequestStatus.FINISHED, FinishReason.STOP)
                return True
        if n >= params.max_tokens:
            self.finish(RequestStatus.FINISHED, FinishReason.LENGTH)
            return True
        return False
