"""Turns the logits of the sampling positions into next tokens (and their logprobs).

Logit bias and penalties come first (pd_cluster/penalties.py), then the min_tokens mask, then
greedy argmax or sampling. Seeded requests draw their noise from a generator of their own,
advanced once per step, so a request's samples do not depend on which other requests share
its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.penalties import Penalties
from pd_cluster.request import Request
from pd_cluster.upload import upload


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self.penalties = Penalties(device)

    def skip_draw(self, request: Request, vocab_size: int) -> None:
        """Advance a seeded request's generator past one draw made by another engine (its
        prefill engine sampled the first token), so the stream continues as if colocated."""
        gen = self._generator(request)
        if gen is not None and not request.params.greedy:
            torch.empty(vocab_size, device=self.device).exponential_(generator=gen)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> "Samples":
        """logits: [S, V] fp32, one row per request -> the samples, still on the device."""
        self.penalties.apply(logits, requests)
        self._mask_stop_tokens(logits, requests)
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled_rows:
            rows = upload(sampled_rows, torch.long, logits.device)
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in sampled_rows])
        self.penalties.remember(requests, tokens)
        top = max((r.params.logprobs or 0 for r in requests if r.params.logprobs is not None),
                  default=None)
        if top is None:
            return Samples(tokens)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        top_v, top_i = logprobs.topk(top, dim=-1) if top else (None, None)
        return Samples(tokens, chosen, top_v, top_i)

    @staticmethod
    def _mask_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        """Before min_tokens is reached, EOS and stop ids cannot be picked."""
        for i, r in enumerate(requests):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    banned |= r.eos_token_ids
                if banned:
                    logits[i, upload(sorted(banned), torch.long, logits.device)] = float("-inf")

    def probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k/top-p/min-p (the
        one definition speculative verification shares, pd_cluster/spec_decode/verify.py)."""
        temp = upload([r.params.temperature for r in requests], torch.float32, logits.device)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        if any(r.params.top_k or r.params.top_p < 1 or r.params.min_p > 0 for r in requests):
            probs = self._filter(probs, requests)   # a full sort of the vocabulary: only if asked
        return probs

    def generator(self, request: Request) -> torch.Generator | None:
        """A seeded request's own generator (None: unseeded, the global one draws)."""
        return self._generator(request)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        probs = self.probs(logits, requests)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. Unseeded rows
        # share one draw; a seeded row draws from its own generator.
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(requests):
            gen = self._generator(r)
            if gen is not None:
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Top-k, then top-p, then min-p; each row keeps at least its most likely token."""
        dev = probs.device
        top_k = upload([r.params.top_k or probs.shape[1] for r in requests], torch.long, dev)
        top_p = upload([r.params.top_p for r in requests], torch.float32, dev)
        min_p = upload([r.params.min_p for r in requests], torch.float32, dev)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=dev)[None, :]
        drop = rank >= top_k[:, None]
        kept = sorted_p.masked_fill(drop, 0.0)
        mass_before = kept.cumsum(dim=-1) - kept
        drop |= mass_before >= top_p[:, None] * kept.sum(-1, keepdim=True)
        drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_p)

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.params.seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.params.seed)
            self._generators[request.request_id] = gen
        return gen



@dataclass(slots=True)
class Samples:
    """One step's sampled tokens [S] (and, when asked, logprobs: the chosen token's [S] and the
    top ones [S, K]); on the device until `to_host`, so the next step can be launched first."""

    tokens: torch.Tensor
    chosen: torch.Tensor | None = None
    top_v: torch.Tensor | None = None
    top_i: torch.Tensor | None = None

    def to_host(self) -> "Samples":
        """Start copying to the host; read the copy only after the step's event has fired."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":
                return t
            # Pinned memory: only then is a device-to-host copy truly asynchronous.
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return Samples(copy(self.tokens), copy(self.chosen), copy(self.top_v), copy(self.top_i))

    def results(self, requests: list[Request]) -> list[tuple[int, dict[int, float] | None]]:
        """(token, logprobs or None) per request; host tensors only."""
        tokens = self.tokens.tolist()
        chosen = self.chosen.tolist() if self.chosen is not None else None
        top_v = self.top_v.tolist() if self.top_v is not None else None
        top_i = self.top_i.tolist() if self.top_i is not None else None
        out = []
        for i, (r, tok) in enumerate(zip(requests, tokens)):
            n = r.params.logprobs
            if n is None:
                out.append((tok, None))
                continue
            lp = {tok: chosen[i]}
            if n:
                lp.update(zip(top_i[i][:n], top_v[i][:n]))
            out.append((tok, lp))
        return out

