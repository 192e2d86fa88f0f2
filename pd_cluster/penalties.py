"""Logit bias and the presence, frequency and repetition penalties, applied to a batch of
logits on the device with vLLM's semantics and in vLLM v1's order:

    1. logit_bias            logits[t] += bias[t]                                (OpenAI)
    2. repetition_penalty p  over every token seen, prompt and output alike      (HF, CTRL)
                             logits[t] /= p if logits[t] > 0, else logits[t] *= p
    3. frequency_penalty f,  over the output tokens only, counted:               (OpenAI)
       presence_penalty q    logits[t] -= f * count[t] + q * (count[t] > 0)

Only the rows whose request asks for one of these are touched, so a batch where none does
costs one pass over its params. The counts are rebuilt every step from the rows' token ids
(one upload of those rows' tokens, scattered on the device): no state per request to keep
in step with preemption, migration or a prefill engine that sampled the first token.

Async scheduling: a request's last output token may still be on the device (PENDING_TOKEN),
sampled by the step before; it is counted from that step's samples (`PreviousSamples`).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pd_cluster.request import PENDING_TOKEN, Request
from pd_cluster.upload import upload, upload_many


@dataclass(slots=True)
class PreviousSamples:
    """The sampler's previous call: its requests in row order and their tokens (on the
    device). A request whose last output token is PENDING_TOKEN got it there."""

    requests: list[Request]
    tokens: torch.Tensor


def apply_penalties(logits: torch.Tensor, requests: list[Request],
                    previous: PreviousSamples | None = None) -> None:
    """Bias and penalize `logits` [S, V] (one row per request) in place."""
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return
    chosen = [requests[i] for i in rows]
    index = upload(rows, torch.long, logits.device)
    logits[index] = penalize(logits[index], chosen, previous)


def penalize(logits: torch.Tensor, requests: list[Request],
             previous: PreviousSamples | None) -> torch.Tensor:
    """`logits` [R, V] of requests that each ask for a bias or a penalty, transformed."""
    dev, vocab = logits.device, logits.shape[1]
    biased = [(i, r.params.logit_bias) for i, r in enumerate(requests) if r.params.logit_bias]
    if biased:
        at = [i * vocab + t for i, bias in biased for t in bias]
        values = [b for _, bias in biased for b in bias.values()]
        logits.view(-1).index_add_(0, upload(at, torch.long, dev),
                                   upload(values, torch.float32, dev))
    counts = output_counts(requests, vocab, dev, previous)
    repetition = [r.params.repetition_penalty for r in requests]
    if any(p != 1.0 for p in repetition):
        seen = counts > 0
        seen.view(-1)[_flat([r.prompt_token_ids if p != 1.0 else [] for r, p in
                             zip(requests, repetition)], vocab, dev)] = True
        factor = torch.where(seen, upload(repetition, torch.float32, dev)[:, None], 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    frequency = upload([r.params.frequency_penalty for r in requests], torch.float32, dev)
    presence = upload([r.params.presence_penalty for r in requests], torch.float32, dev)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def output_counts(requests: list[Request], vocab: int, device: torch.device,
                  previous: PreviousSamples | None) -> torch.Tensor:
    """[R, V] float32: how often each row's request has output each token so far."""
    counts = torch.zeros(len(requests), vocab, dtype=torch.float32, device=device)
    known = [_known_outputs(r) for r in requests]
    flat = _flat(known, vocab, device)
    counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, device=device))
    pending = [i for i, r in enumerate(requests)
               if r.output_token_ids and r.output_token_ids[-1] == PENDING_TOKEN]
    if pending:
        if previous is None:
            raise RuntimeError("a request's last token is still on the device, but the "
                               "sampler was not given the step that sampled it")
        where = {r.request_id: i for i, r in enumerate(previous.requests)}
        source = upload([where[requests[i].request_id] for i in pending], torch.long, device)
        at = upload(pending, torch.long, device) * vocab + previous.tokens[source]
        counts.view(-1).index_add_(0, at, torch.ones(len(pending), device=device))
    return counts


def _known_outputs(request: Request) -> list[int]:
    out = request.output_token_ids
    return out[:-1] if out and out[-1] == PENDING_TOKEN else out


def _flat(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Indices into a flattened [len(token_lists), vocab] tensor: row * vocab + token."""
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64,
                         count=int(lengths.sum()))
    flat = np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab, lengths) + tokens
    return upload_many([flat], device)[0]
