"""Continuous batching under a per-step token budget: decodes first, then chunked prefills.

Every request is "N tokens known, C computed"; a step computes some of the N - C. A decode is
the case N - C == 1. When the KV cache runs dry, the most recently admitted running request is
preempted: its blocks are freed and it is recomputed later from prompt + generated tokens.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pd_cluster.kv_cache_manager import KVCacheManager
from pd_cluster.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int       # tokens computed this step
    samples: bool         # this step reaches the end of the known tokens, so it samples
    # Speculative decoding: d1..dk after the last token, verified in this step's forward
    # (num_tokens == 1 + k); none of their KV counts as computed until verification keeps it.
    draft: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step, decodes first (what the attention metadata relies on)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # freed this step, will recompute

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start (for metrics and for tests that must see a mechanism fire)."""

    num_preemptions: int = 0
    prefix_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0      # of which were found cached


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.parked: dict[str, Request] = {}    # decode side: blocks reserved, KV on its way
        self.holding: dict[str, Request] = {}   # prefill side: blocks kept while KV is sent
        self.draining: dict[str, Request] = {}  # last token in flight (async scheduling)
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether steps are needed (parked and held requests wait for others, not steps)."""
        return bool(self.waiting or self.running)

    def reserve(self, req: Request) -> int | None:
        """Decode side: allocate blocks for the whole prompt and park the request until its KV
        arrives. Returns how many prompt tokens this engine already has cached (the sender
        skips those), or None when the KV cache cannot take the request now."""
        cached, num_cached = self.kv.find_cached_prefix(req)
        req.num_computed_tokens = num_cached
        if not self.kv.can_allocate(req, req.num_tokens - num_cached, cached):
            req.num_computed_tokens = 0
            return None
        self.kv.allocate(req, req.num_tokens - num_cached, cached)
        req.num_cached_tokens = num_cached
        req.move_to(RequestStatus.WAITING_FOR_KV)
        self.requests[req.request_id] = req
        self.parked[req.request_id] = req
        return num_cached

    def resume(self, request_id: str, token: int, logprobs: dict[int, float] | None) -> Request:
        """Decode side: the prompt's KV has landed; join the running batch with its first token."""
        req = self.parked.pop(request_id)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_computed_blocks(req)
        req.append_token(token, logprobs)
        if req.check_stop():
            self._remove(req)
        else:
            req.move_to(RequestStatus.RUNNING)
            self.running.append(req)
        return req

    def release(self, request_id: str) -> None:
        """Prefill side: the KV of a held request has been sent; free its blocks."""
        req = self.holding.get(request_id)
        if req is not None:
            req.finish(RequestStatus.FINISHED, FinishReason.LENGTH)
            self._remove(req)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Plan a step. `drafts`: speculative proposals of running decodes (request id ->
        d1..dk); each such decode is planned as a chunk of 1 + k tokens, after the plain
        decodes (which the attention metadata wants leading), while the budget lasts."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        drafts = drafts or {}
        # Decodes first (plain, then speculating), then prefills already under way;
        # preemption only ever hits `running`.
        decodes = [r for r in self.running if self._is_decode(r)]
        order = ([r for r in decodes if r.request_id not in drafts]
                 + [r for r in decodes if r.request_id in drafts]
                 + [r for r in self.running if not self._is_decode(r)])
        for req in order:
            if req.status is RequestStatus.WAITING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.max_prefill_chunk)
            draft = drafts.get(req.request_id, [])[:max(0, budget - 1)]
            if draft and not self.kv.can_allocate(req, n + len(draft)):
                draft = []      # speculation never preempts anyone
            n += len(draft)
            if n > 0 and self._make_room(req, n, out):
                self.kv.allocate(req, n)
                out.scheduled.append(self._plan(req, n, draft))
                budget -= n
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached, num_cached = self.kv.find_cached_prefix(req)
            n = min(req.num_tokens - num_cached, budget, self.max_prefill_chunk)
            req.num_computed_tokens = num_cached
            if not self.kv.can_allocate(req, n, cached):
                req.num_computed_tokens = 0
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.scheduled_time = time.monotonic()   # a request trace's queue span ends here
                self.stats.prefix_queries += req.num_tokens
                self.stats.prefix_hits += num_cached
            self.kv.allocate(req, n, cached)
            self.running.append(req)
            out.scheduled.append(self._plan(req, n))
            budget -= n
        return budget

    def _make_room(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `req` fits; False if `req` itself went."""
        while not self.kv.can_allocate(req, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        req.move_to(RequestStatus.WAITING)
        self.waiting.appendleft(req)
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _plan(self, req: Request, n: int, draft: list[int] | None = None) -> ScheduledRequest:
        samples = req.num_computed_tokens + n - len(draft or ()) == req.num_tokens
        if req.status is not RequestStatus.RUNNING:
            req.move_to(RequestStatus.RUNNING if samples else RequestStatus.PREFILLING)
        return ScheduledRequest(req, n, samples, draft or [])

    @staticmethod
    def _is_decode(req: Request) -> bool:
        return req.num_tokens - req.num_computed_tokens == 1

    def advance(self, out: SchedulerOutput) -> None:
        """The step has been launched: count its tokens as computed and give each request that
        samples a pending token, so the next step can be scheduled before this one's tokens
        are known (async scheduling). `record` fills the tokens in."""
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # ended (stop, abort) after this step was planned
                continue
            req.num_computed_tokens += s.num_tokens - len(s.draft)
            self.kv.cache_computed_blocks(req)
            if s.samples:
                req.append_pending()
                if req.hold_kv:
                    self._hold(req)
                elif len(req.output_token_ids) >= req.params.max_tokens:
                    # Its last token is in flight: nothing is left to compute, whatever the
                    # token turns out to be, so it must not be scheduled again.
                    self.running.remove(req)
                    self.draining[req.request_id] = req

    def record(self, out: SchedulerOutput,
               sampled: dict[str, tuple[int, dict[int, float] | None]],
               more: dict[str, list[int]] | None = None) -> list[Request]:
        """The step's tokens are known: fill them in and check stops; returns the requests
        that finished (a held request counts: its stream is over on this engine).
        `more`: a speculating request's tokens after its first (verification kept its drafts
        up to there); the KV of the rejected drafts is rolled back."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if not s.samples or req.is_finished:
                continue
            token, logprobs = sampled[req.request_id]
            req.fill_pending(token, logprobs)
            if req.hold_kv:
                finished.append(req)
            elif req.check_stop() or (s.draft and self._keep_drafts(req, more[req.request_id])):
                self._remove(req)
                finished.append(req)
        return finished

    def _keep_drafts(self, req: Request, tokens: list[int]) -> bool:
        """Append a verified request's further tokens (each is the draft whose KV the step
        computed, so that KV counts from now on) until a stop; then drop the blocks past its
        tokens. True if it finished."""
        for token in tokens:
            req.num_computed_tokens += 1
            req.append_token(token, None)
            if req.check_stop():
                return True
        # Only now: the hashed blocks hold kept tokens alone. The rejected drafts' KV sits
        # past num_computed_tokens, to be overwritten; blocks beyond the tokens go back.
        self.kv.cache_computed_blocks(req)
        self.kv.truncate(req, req.num_tokens)
        return False

    def finish(self, request_id: str, status: RequestStatus, reason: FinishReason,
               error: str | None = None) -> Request | None:
        """End a request from outside (abort, stop string, failure); frees its blocks."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.finish(status, reason, error=error)
        self._remove(req)
        return req

    def _hold(self, req: Request) -> None:
        self.running.remove(req)
        req.move_to(RequestStatus.TRANSFERRING)
        self.holding[req.request_id] = req

    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        parked = self.parked.pop(req.request_id, None) is not None
        self.holding.pop(req.request_id, None)
        self.draining.pop(req.request_id, None)
        # A parked request's KV had not landed: its sender may still be writing the blocks
        # past our prefix hit (the KV cache manager quarantines those, if enabled).
        self.kv.free(req, req.num_cached_tokens // self.kv.block_size if parked else None)
        self.requests.pop(req.request_id, None)
