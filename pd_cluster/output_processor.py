"""Turns sampled tokens into streamed text: detokenization, stop strings, final outputs."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.request import FinishReason, Request, RequestStatus
from pd_cluster.sampler import Sampler
from pd_cluster.scheduler import Scheduler, SchedulerOutput
from pd_cluster.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer


@dataclass(slots=True)
class _Stream:
    detok: IncrementalDetokenizer | None
    stops: StopChecker
    num_sent_tokens: int = 0      # tokens fed to the detokenizer
    num_reported_tokens: int = 0  # tokens already in an output's delta
    text: str = ""
    pending: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, req: Request) -> None:
        detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
                 if self.tokenizer else None)
        # Stop strings only count once min_tokens are out, so the checker starts empty then.
        stops = StopChecker([] if req.params.min_tokens else req.params.stop)
        self._streams[req.request_id] = _Stream(detok, stops)

    def is_streaming(self, request_id: str) -> bool:
        return request_id in self._streams

    def process(self, plan: SchedulerOutput, finished: list[Request], scheduler: Scheduler,
                sampler: Sampler) -> list[RequestOutput]:
        """Outputs of every request that got a token this step, finishing on stop strings."""
        outs = []
        ended = {r.request_id for r in finished}
        for s in plan.scheduled:
            req = s.request
            if not s.samples:
                continue
            if req.request_id not in ended and self._hit_stop_string(req):
                scheduler.finish(req.request_id, RequestStatus.FINISHED, FinishReason.STOP)
            if req.is_finished or req.request_id in ended:
                sampler.forget(req.request_id)
                outs.append(self.finalize(req))
            else:
                outs.append(self._output(req))
        return outs

    def _hit_stop_string(self, req: Request) -> bool:
        stream = self._streams[req.request_id]
        first = stream.num_sent_tokens
        new_tokens = req.output_token_ids[first:]
        stream.num_sent_tokens = len(req.output_token_ids)
        if stream.detok is None:
            return False
        if (not stream.stops.stop_strings and req.params.stop
                and len(req.output_token_ids) >= req.params.min_tokens):
            stream.stops = StopChecker(req.params.stop)
        if len(new_tokens) <= 1 or not stream.stops.stop_strings:
            stream.pending.append(stream.stops.append(stream.detok.add(new_tokens)))
            return stream.stops.stopped
        # Several tokens at once (a speculative step's): one at a time, as plain decoding
        # would have seen them, so that the output ends at the token completing a stop string.
        for j, token in enumerate(new_tokens):
            stream.pending.append(stream.stops.append(stream.detok.add([token])))
            if stream.stops.stopped:
                if j + 1 < len(new_tokens):
                    del req.output_token_ids[first + j + 1:]
                    stream.num_sent_tokens = len(req.output_token_ids)
                    if req.is_finished:     # by a later stop token or the length limit
                        req.finish_reason, req.stop_reason = FinishReason.STOP, None
                break
        return stream.stops.stopped

    def _output(self, req: Request, finished: bool = False) -> RequestOutput:
        stream = self._streams[req.request_id]
        delta = "".join(stream.pending)
        stream.pending.clear()
        stream.text += delta
        tokens = req.output_token_ids
        delta_ids = tokens[stream.num_reported_tokens:]
        stream.num_reported_tokens = len(tokens)
        done = CompletionOutput(0, stream.text, tokens,
                                req.output_logprobs if req.params.logprobs is not None
                                else None, req.finish_reason, req.stop_reason)
        if tokens and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        return RequestOutput(req.request_id, req.prompt_token_ids, [done], finished,
                             max(req.num_cached_tokens, 0), delta, delta_ids, req.error, ttft,
                             req.spec_proposed_tokens, req.spec_accepted_tokens,
                             (req.arrival_time, req.scheduled_time, req.first_token_time,
                              time.monotonic(), req.grammar_time) if finished else None)

    def finalize(self, req: Request) -> RequestOutput:
        """The last output of a finished request; forgets its streaming state."""
        stream = self._streams[req.request_id]
        if stream.detok is not None:
            if req.output_token_ids[stream.num_sent_tokens:]:
                self._hit_stop_string(req)
            if not stream.stops.stopped:
                stream.pending.append(stream.stops.append(stream.detok.flush())
                                      + stream.stops.flush())
        out = self._output(req, finished=True)
        del self._streams[req.request_id]
        return out
