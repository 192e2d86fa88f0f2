"""The batch's grammar masks: computed on the host while the forward pass runs, applied on
the device as one masked fill before sampling.

The model runner launches a step's forward pass (queued on the device, not waited for), then
calls `GrammarConstraint.apply`: it waits only for the step before (whose sampled tokens are
the constrained requests' newest), advances their matchers, fills one bitmask row per
constrained request on llguidance's thread pool, sends the bitmask up and masks the logits.
The device meanwhile runs this step's forward pass, so a mask costs the step nothing as long
as the batch's masks take less host time than the forward pass.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from pd_cluster.request import PENDING_TOKEN, Request
from pd_cluster.structured.bitmask import apply_bitmask, bitmask_words
from pd_cluster.structured.matcher import GrammarState, GrammarVocabulary


class GrammarConstraint:
    """Masks the logits of a step's grammar-constrained rows; one per engine."""

    def __init__(self, vocab: GrammarVocabulary):
        self.vocab = vocab
        self._executor: Any = None
        self._one_token: list[tuple[GrammarState, int]] = []   # consumed in parallel

    def apply(self, logits: torch.Tensor, requests: list[Request], prev: Any) -> None:
        """logits: [S, V], row i for requests[i]; `prev`: the step still in flight (its
        LaunchedStep), whose tokens some requests' last output still waits for."""
        rows = [i for i, r in enumerate(requests) if r.params.grammar is not None]
        if not rows:
            return
        pending = prev.result() if prev is not None and any(
            requests[i].output_token_ids[-1:] == [PENDING_TOKEN] for i in rows) else {}
        states = [self._state(requests[i], pending) for i in rows]
        self._consume_queued()
        matchers = [(s.matcher, i) for s, i in zip(states, rows) if s.constrains]
        if matchers:
            self._mask(logits, matchers)

    def _state(self, req: Request, pending: dict) -> GrammarState:
        """The request's matcher, advanced over its tokens so far. A decode step's one new
        token is queued for the batch's parallel consume, done in `_mask`."""
        if req.grammar_state is None:
            req.grammar_state = GrammarState.start(self.vocab, req.params.grammar)
        state = req.grammar_state
        last = pending[req.request_id][0] if req.output_token_ids[-1:] == [PENDING_TOKEN] \
            else None
        new = state.unconsumed(req.output_token_ids, last)
        if len(new) == 1 and not state.failed:
            self._one_token.append((state, new[0]))
        else:
            state.consume(new)
        return state

    @property
    def executor(self) -> Any:
        """llguidance's thread pool, on half the cores: the other half plan the next step
        (and, on a CPU engine, run the forward pass) meanwhile."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=min(16, max(1, (os.cpu_count() or 2) // 2)))
        return self._executor

    def _consume_queued(self) -> None:
        if self._one_token:
            oks = self.executor.consume_token_par([(s.matcher, t) for s, t in self._one_token])
            for (state, _), ok in zip(self._one_token, oks):
                state.consumed_one(ok)
            self._one_token.clear()

    def _mask(self, logits: torch.Tensor, matchers: list[tuple[Any, int]]) -> None:
        cuda = logits.device.type == "cuda"
        # llguidance writes its whole vocabulary: a tokenizer larger than the logits (added
        # tokens the model cannot produce) gets a wider mask, cut to the logits on apply.
        words = bitmask_words(max(logits.shape[1], self.vocab.tokenizer.vocab_size))
        bitmask = torch.empty((len(matchers), words), dtype=torch.int32, pin_memory=cuda)
        # llguidance.torch's fill_next_token_bitmask_par, without importing that module
        # (it compiles a kernel with torch.compile at import).
        self.executor.unsafe_compute_mask_ptr([(m, k) for k, (m, _) in enumerate(matchers)],
                                              bitmask.data_ptr(), words * 4, len(matchers))
        rows = torch.tensor([i for _, i in matchers], dtype=torch.long, pin_memory=cuda)
        apply_bitmask(logits, rows.to(logits.device, non_blocking=True),
                      bitmask.to(logits.device, non_blocking=True))
