"""Verification: which proposed tokens a sequence keeps, from one target forward.

A speculating sequence's step has k + 1 query tokens [t, d1..dk] (its last token and the
proposals), so the target gives k + 1 distributions p0..pk: p_i is the next-token
distribution after d_i (p0 after t).

- Greedy: keep d1..dj while d_i == argmax p_{i-1}, then add argmax p_j (the correction, or the
  bonus token when all k were kept). Exactly the tokens plain greedy decoding gives.
- Sampling (Leviathan et al. 2023, Chen et al. 2023): keep d_i with probability
  min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); at the first rejection draw from norm(max(0, p - q))
  instead; with all kept, draw the bonus token from pk. Each emitted token is then distributed
  exactly as p. q is the draft model's distribution, or one-hot on d_i for n-gram proposals
  (acceptance probability p(d_i), and the residual is p without d_i). p is what the sampler
  itself would draw from (`Sampler.probs`: temperature, top-k, top-p, min-p), and a seeded
  request draws from its own generator, so its output is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.request import Request
from pd_cluster.sampler import Sampler


@dataclass(slots=True)
class SpecRow:
    """One speculating sequence of a step."""

    request: Request
    draft: list[int]                          # d1..dk
    draft_probs: torch.Tensor | None = None   # [k, V] q of a sampling draft model; None: one-hot


def verify(logits: torch.Tensor, rows: list[SpecRow], sampler: Sampler) -> list[list[int]]:
    """logits: [sum(k_i + 1), V], each row's k_i + 1 consecutive. Returns each row's emitted
    tokens (1..k_i + 1 of them: the kept proposals, then one drawn from the target)."""
    out: list[list[int]] = [[] for _ in rows]
    starts, at = [], 0
    for row in rows:
        starts.append(at)
        at += len(row.draft) + 1
    greedy = [i for i, r in enumerate(rows) if r.request.params.greedy]
    if greedy:
        best = logits.argmax(dim=-1).tolist()     # one device sync for every greedy row
        for i in greedy:
            target = best[starts[i]:starts[i] + len(rows[i].draft) + 1]
            out[i] = _accept_greedy(rows[i].draft, target)
    for i, row in enumerate(rows):
        if not row.request.params.greedy:
            k = len(row.draft)
            out[i] = _accept_sampled(logits[starts[i]:starts[i] + k + 1], row, sampler)
    return out


def _accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    j = 0
    while j < len(draft) and draft[j] == target[j]:
        j += 1
    return target[:j + 1]


def _accept_sampled(logits: torch.Tensor, row: SpecRow, sampler: Sampler) -> list[int]:
    req, k = row.request, len(row.draft)
    p = sampler.probs(logits.float(), [req] * (k + 1))         # [k + 1, V]
    gen = sampler.generator(req)
    draft = torch.tensor(row.draft, device=p.device)
    steps = torch.arange(k, device=p.device)
    p_d = p[steps, draft]
    q_d = row.draft_probs[steps, draft] if row.draft_probs is not None else torch.ones_like(p_d)
    u = torch.rand(k, device=p.device, generator=gen)
    kept = (u * q_d < p_d).tolist()                               # u < p / q, q > 0
    j = kept.index(False) if False in kept else k
    if j < k:
        q = row.draft_probs[j] if row.draft_probs is not None else \
            torch.nn.functional.one_hot(draft[j], p.shape[1]).to(p.dtype)
        dist = (p[j] - q).clamp_(min=0)
        if float(dist.sum()) <= 0:      # p == q to rounding: the rejection was rounding too
            dist = p[j]
    else:
        dist = p[k]
    noise = torch.empty_like(dist).exponential_(generator=gen)   # argmax(dist / E): a draw
    return row.draft[:j] + [int((dist / noise).argmax())]
