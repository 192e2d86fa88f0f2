"""Turns the logits of the sampling positions into next tokens (and their logprobs).

Seeded requests draw their noise from a generator of their own, advanced once per step, so a
request's samples do not depend on which other requests share its batch.
"""
from __future__ import annotations

import torch

from pd_cluster.request import Request


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def skip_draw(self, request: Request, vocab_size: int) -> None:
        """Advance a seeded request's generator past one draw made by another engine (its
        prefill engine sampled the first token), so the stream continues as if colocated."""
        gen = self._generator(request)
        if gen is not None and not request.params.greedy:
            torch.empty(vocab_size, device=self.device).exponential_(generator=gen)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor,
                 requests: list[Request]) -> list[tuple[int, dict[int, float] | None]]:
        """logits: [S, V] fp32, one row per request -> (token, logprobs or None) per request."""
        self._mask_stop_tokens(logits, requests)
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in sampled_rows])
        return self._results(tokens, logprobs, requests)

    @staticmethod
    def _mask_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        """Before min_tokens is reached, EOS and stop ids cannot be picked."""
        for i, r in enumerate(requests):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    banned |= r.eos_token_ids
                if banned:
                    logits[i, list(banned)] = float("-inf")

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in requests], device=dev)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        probs = self._filter(probs, requests)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            noise[i].exponential_(generator=self._generator(r))
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Top-k, then top-p, then min-p; each row keeps at least its most likely token."""
        dev = probs.device
        top_k = torch.tensor([r.params.top_k or probs.shape[1] for r in requests], device=dev)
        top_p = torch.tensor([r.params.top_p for r in requests], device=dev)
        min_p = torch.tensor([r.params.min_p for r in requests], device=dev)
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

    @staticmethod
    def _results(tokens: torch.Tensor, logprobs: torch.Tensor | None,
                 requests: list[Request]) -> list[tuple[int, dict[int, float] | None]]:
        token_list = tokens.tolist()
        out = []
        for i, (r, tok) in enumerate(zip(requests, token_list)):
            if r.params.logprobs is None:
                out.append((tok, None))
                continue
            lp = {tok: logprobs[i, tok].item()}
            if r.params.logprobs:
                top_v, top_i = logprobs[i].topk(r.params.logprobs)
                lp.update(zip(top_i.tolist(), top_v.tolist()))
            out.append((tok, lp))
        return out
