"""Logit bias and the presence, frequency and repetition penalties, applied to a batch of
logits on the device with vLLM's semantics and in vLLM v1's order:

    1. logit_bias            logits[t] += bias[t]                                (OpenAI)
    2. repetition_penalty p  over every token seen, prompt and output alike      (HF, CTRL)
                             logits[t] /= p if logits[t] > 0, else logits[t] *= p
    3. frequency_penalty f,  over the output tokens only, counted:               (OpenAI)
       presence_penalty q    logits[t] -= f * count[t] + q * (count[t] > 0)

Only the rows whose request asks for one of these are touched, so a batch where none does
costs one pass over its params. The output counts are rebuilt every step from the rows'
output token ids (scattered on the device): no running count to keep in step with
preemption, migration or a prefill engine that sampled the first token. The prompt's tokens,
which never change and are most of a long request's, go up once: `Penalties` keeps them on
the device while their request keeps sampling.

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


class Penalties:
    """Biases and penalizes the sampler's logits; remembers what spans steps: the last
    samples, and the distinct prompt tokens of the requests with a repetition penalty (on
    the device, dropped once their request is missing from a step's batch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._previous: PreviousSamples | None = None
        self._prompts: dict[Request, torch.Tensor] = {}   # by identity (Request: eq=False)

    def remember(self, requests: list[Request], tokens: torch.Tensor) -> None:
        """This step's samples: the next step's pending tokens."""
        self._previous = PreviousSamples(requests, tokens)

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Bias and penalize `logits` [S, V] (one row per request) in place."""
        rows = [i for i, r in enumerate(requests) if r.params.penalized]
        chosen = [requests[i] for i in rows]
        if rows or self._prompts:
            self._prompts = {r: self._prompt(r) for r in chosen
                             if r.params.repetition_penalty != 1.0}
        if rows:
            index = upload(rows, torch.long, logits.device)
            logits[index] = penalize(logits[index], chosen, self._previous, self._prompts)

    def _prompt(self, request: Request) -> torch.Tensor:
        cached = self._prompts.get(request)
        if cached is None:
            distinct = np.unique(np.asarray(request.prompt_token_ids, dtype=np.int64))
            cached = upload_many([distinct], self.device)[0]
        return cached


def penalize(logits: torch.Tensor, requests: list[Request], previous: PreviousSamples | None,
             prompts: dict[Request, torch.Tensor]) -> torch.Tensor:
    """`logits` [R, V] of requests that each ask for a bias or a penalty, transformed.
    `prompts`: by request, the distinct prompt tokens (on the device) of those with a
    repetition penalty."""
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
        seen.view(-1)[_prompt_indices(requests, vocab, dev, prompts)] = True
        factor = torch.where(seen, upload(repetition, torch.float32, dev)[:, None], 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    frequency = upload([r.params.frequency_penalty for r in requests], torch.float32, dev)
    presence = upload([r.params.presence_penalty for r in requests], torch.float32, dev)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def output_counts(requests: list[Request], vocab: int, device: torch.device,
                  previous: PreviousSamples | None) -> torch.Tensor:
    """[R, V] float32: how often each row's request has output each token so far."""
    counts = torch.zeros(len(requests), vocab, dtype=torch.float32, device=device)
    flat = _flat([_known_outputs(r) for r in requests], vocab, device)
    counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, device=device))
    pending = [i for i, r in enumerate(requests)
               if r.output_token_ids and r.output_token_ids[-1] == PENDING_TOKEN]
    if pending:
        if previous is None:
            raise RuntimeError("a request's last token is still on the device, but the "
                               "sampler was not given the step that sampled it")
        where = {id(r): i for i, r in enumerate(previous.requests)}
        source = upload([where[id(requests[i])] for i in pending], torch.long, device)
        at = upload(pending, torch.long, device) * vocab + previous.tokens[source]
        counts.view(-1).index_add_(0, at, torch.ones(len(pending), device=device))
    return counts


def _prompt_indices(requests: list[Request], vocab: int, device: torch.device,
                    prompts: dict[Request, torch.Tensor]) -> torch.Tensor:
    """row * vocab + token for the prompt tokens of the rows with a repetition penalty."""
    rows = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
    tokens = [prompts[requests[i]] for i in rows]
    lengths = [len(t) for t in tokens]
    offsets = upload(rows, torch.long, device) * vocab
    # output_size: known here, so the device need not be asked (a sync) for it.
    return torch.cat(tokens) + offsets.repeat_interleave(
        upload(lengths, torch.long, device), output_size=sum(lengths))


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
