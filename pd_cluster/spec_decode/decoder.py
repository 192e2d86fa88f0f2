"""The engine's speculation policy: who speculates this step, with what, and how it went.

Per step (pd_cluster/engine.py): `wants_step` decides whether any running sequence may
speculate; if so the engine first collects the step in flight (proposals need every sequence's
last token), `propose` gives each eligible decode its draft, the scheduler plans those decodes
as k + 1 token chunks, and after verification `observe` counts what was kept.

Fallbacks, so speculation never costs much where it does not pay:
- a batch of more than `max_batch_size` running sequences decodes plainly (and keeps async
  scheduling and CUDA graphs): the verification tokens would make a compute-bound step longer;
- a sequence whose acceptance-rate EWMA drops below `min_acceptance_rate` after
  `min_steps_before_fallback` verifications stops speculating for good;
- a sequence whose n-gram lookup finds nothing sits out 1, 2, 4 .. 16 steps before it looks
  again, so that a batch with nothing to copy is not held to synchronous steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_cluster.request import PENDING_TOKEN, Request, RequestStatus
from pd_cluster.spec_decode.config import SpeculativeConfig
from pd_cluster.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    import torch

    from pd_cluster.spec_decode.draft import DraftProposer


def can_speculate(request: Request) -> bool:
    """Whether a request's sampling allows speculation at all. Requests whose next-token
    distribution depends on the tokens before it in ways verification does not model stay
    plain: logprobs (reported per step), a min_tokens floor not yet reached (stop tokens
    masked), a grammar (its mask depends on every token before) and biases or penalties
    (they change the logits verification would have to reproduce per position)."""
    p = request.params
    return (p.logprobs is None and p.grammar is None and not p.penalized
            and not request.hold_kv
            and len(request.output_token_ids) >= p.min_tokens)


@dataclass(slots=True)
class SpecStats:
    """Counters since start (the pd_spec_decode_* metrics)."""

    steps: int = 0                 # steps that verified at least one draft
    proposed: int = 0              # draft tokens verified
    accepted: int = 0              # of which were kept
    emitted: int = 0               # tokens emitted by speculating sequences (kept + 1 each)
    seq_fallbacks: int = 0         # sequences that stopped speculating (low acceptance)
    batch_fallbacks: int = 0       # steps that decoded plainly because the batch was too big

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "proposed": self.proposed, "accepted": self.accepted,
                "emitted": self.emitted, "seq_fallbacks": self.seq_fallbacks,
                "batch_fallbacks": self.batch_fallbacks,
                "acceptance_rate": self.acceptance_rate}


# A sequence n-gram lookup found nothing for sits out this many steps (doubling per miss, up
# to the maximum), so that a batch with nothing to copy keeps async scheduling.
MISS_BACKOFF_MAX = 16


@dataclass(slots=True)
class _Sequence:
    ewma: float = 1.0
    steps: int = 0
    stopped: bool = False
    backoff: int = 0          # steps it sits out after its latest miss
    resume_at: int = 0        # the step count from which it may propose again


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None):
        self.config = config
        self.draft = draft
        self.stats = SpecStats()
        self._seqs: dict[str, _Sequence] = {}
        self._now = 0             # wants_step calls: the clock of the miss backoff

    def _room(self, req: Request, in_flight: bool = False) -> int:
        """Tokens it may propose for `req` now (0: it decodes plainly this step).
        `in_flight`: judge it as it will be once the step in flight is recorded (its last
        token may be pending now)."""
        pending = req.output_token_ids[-1:] == [PENDING_TOKEN]
        if (req.status is not RequestStatus.RUNNING or not can_speculate(req)
                or req.num_tokens - req.num_computed_tokens != 1
                or (pending and not in_flight)):
            return 0
        seq = self._seqs.get(req.request_id)
        if seq is not None and (seq.stopped or self._now < seq.resume_at):
            return 0
        # The step emits up to k + 1 tokens: never past max_tokens.
        left = req.params.max_tokens - len(req.output_token_ids) - 1
        return max(0, min(self.config.num_speculative_tokens, left))

    def wants_step(self, running: list[Request]) -> bool:
        """Whether the next step should speculate (cheap: called every step)."""
        self._now += 1
        if not running:
            return False
        if len(running) > self.config.max_batch_size:
            self.stats.batch_fallbacks += 1
            return False
        return any(self._room(r, in_flight=True) for r in running)

    def retain(self, live: dict[str, Request]) -> None:
        """Drop the state (and draft KV) of requests the engine no longer has."""
        if len(self._seqs) > len(live):
            for rid in [r for r in self._seqs if r not in live]:
                del self._seqs[rid]
        if self.draft is not None:
            self.draft.forget_except(live)

    def propose(self, running: list[Request]
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Drafts of the eligible running decodes: (request id -> d1..dk, request id -> the
        draft model's q [k, V] for sampling requests)."""
        rooms = {r.request_id: n for r in running if (n := self._room(r))}
        if self.draft is not None:
            wanted = [(r, rooms[r.request_id]) for r in running if r.request_id in rooms]
            return self.draft.propose(wanted)
        c = self.config
        drafts = {}
        for req in running:
            k = rooms.get(req.request_id)
            if k:
                d = propose_ngram(req.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
                seq = self._seqs.setdefault(req.request_id, _Sequence())
                if d:
                    drafts[req.request_id] = d
                    seq.backoff = 0
                else:
                    seq.backoff = min(2 * seq.backoff or 1, MISS_BACKOFF_MAX)
                    seq.resume_at = self._now + seq.backoff
        return drafts, {}

    def observe(self, drafts: dict[str, list[int]], emitted: dict[str, list[int]],
                requests: dict[str, Request]) -> None:
        """A verified step: count what each sequence kept, stop those that keep too little."""
        c = self.config
        self.stats.steps += 1
        for rid, draft in drafts.items():
            tokens = emitted.get(rid)
            if tokens is None:        # not verified after all (ended or preempted meanwhile)
                continue
            kept = len(tokens) - 1
            self.stats.proposed += len(draft)
            self.stats.accepted += kept
            self.stats.emitted += len(tokens)
            req = requests.get(rid)
            if req is not None:
                req.spec_proposed_tokens += len(draft)
                req.spec_accepted_tokens += kept
            seq = self._seqs.setdefault(rid, _Sequence())
            seq.steps += 1
            seq.ewma += c.acceptance_ewma * (kept / len(draft) - seq.ewma)
            if seq.steps >= c.min_steps_before_fallback and seq.ewma < c.min_acceptance_rate:
                seq.stopped = True
                self.stats.seq_fallbacks += 1
