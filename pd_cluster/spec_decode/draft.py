"""Draft-model proposals: a smaller model with the target's vocabulary runs k cheap decode
steps per speculating sequence, on its own paged KV cache, in the engine's process.

The draft keeps a mirror of each speculating request (same id, prompt and sampling params) in
its own KVCacheManager. Before proposing, a mirror is synced with the target's tokens: its KV
is kept up to the longest common prefix (the drafts the target kept stay computed, rejected
ones are recomputed over), and the tokens it lacks are computed first, in chunks of the
engine's token budget (a prompt's first time, after disaggregation or migration: the draft
builds its prompt KV from the prompt tokens on the engine that decodes). Then k - 1 batched
decode steps give d1..dk. A sampling request draws each d_i from the draft's distribution q
(the same temperature and filters as the target's), from a generator seeded by the request's
seed, and q goes to verification.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from pd_cluster.config import DEFAULT_MODEL, EngineConfig, ModelConfig
from pd_cluster.kv_cache_manager import KVCacheManager
from pd_cluster.model_runner import ModelRunner
from pd_cluster.request import Request
from pd_cluster.scheduler import ScheduledRequest, SchedulerOutput

# Share of a GPU the draft model and its KV cache may take when draft_num_kv_blocks is unset.
DRAFT_GPU_SHARE = 0.1


class DraftProposer:
    def __init__(self, config: EngineConfig, max_model_len: int, vocab_size: int):
        spec = config.speculative
        model_dir = spec.draft_model
        if model_dir == DEFAULT_MODEL:
            from pd_cluster.default_model import default_model_path
            model_dir = default_model_path()
        if spec.draft_load_format != "dummy" and not os.path.isdir(model_dir):
            raise FileNotFoundError(f"speculative.draft_model: directory not found: "
                                    f"{model_dir!r}")
        model_cfg = ModelConfig.from_dir(model_dir)
        if model_cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative.draft_model: vocabulary of {model_cfg.vocab_size} "
                             f"tokens, the target's has {vocab_size}: they must be the same")
        self.config = config.model_copy(update=dict(
            model=model_dir, load_format=spec.draft_load_format, speculative=None,
            num_kv_blocks=spec.draft_num_kv_blocks, quantization=None,
            kv_cache_dtype="auto", max_model_len=max_model_len,
            # At most max_batch_size sequences draft at once: its CUDA graphs and KV cap.
            max_num_seqs=spec.max_batch_size,
            gpu_memory_utilization=min(DRAFT_GPU_SHARE, config.gpu_memory_utilization)))
        self.runner = ModelRunner(self.config, model_dir, model_cfg, max_model_len,
                                  os.path.basename(os.path.normpath(model_dir)))
        self.kv = KVCacheManager(self.runner.kv_layout.num_blocks, self.config.block_size,
                                 enable_prefix_caching=False)
        self.sampler = self.runner.sampler
        self._mirrors: dict[str, Request] = {}

    def forget_except(self, live: dict[str, Request]) -> None:
        """Free the mirrors of requests the engine no longer has."""
        if len(self._mirrors) <= len(live) and all(r in live for r in self._mirrors):
            return
        for rid in [r for r in self._mirrors if r not in live]:
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        self.kv.free(self._mirrors.pop(rid))
        self.sampler.forget(rid)

    def _sync(self, req: Request) -> Request:
        m = self._mirrors.get(req.request_id)
        if m is None:
            # A seeded request's drafts come from a stream of their own: were it the
            # verifier's, the drafts and their acceptance draws would be correlated.
            seed = req.params.seed
            params = req.params if seed is None else dataclasses.replace(
                req.params, seed=(seed * 1_000_003 + 1) % 2**63)
            m = self._mirrors[req.request_id] = Request(
                req.request_id, list(req.prompt_token_ids), params)
        common = 0
        for a, b in zip(m.output_token_ids, req.output_token_ids):
            if a != b:
                break
            common += 1
        m.output_token_ids = list(req.output_token_ids)
        m.num_computed_tokens = min(m.num_computed_tokens, m.num_prompt_tokens + common)
        return m

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """d1..dk for each (request, k) whose draft KV could be brought up to date this step,
        and q [k, V] for those that sample."""
        budget = self.config.max_num_batched_tokens
        catch_up, ks = [], {}
        for req, k in wanted:
            m = self._sync(req)
            n = min(m.num_tokens - m.num_computed_tokens, budget)
            if n <= 0 or not self.kv.can_allocate(m, n + k):
                if n > 0:
                    self._drop(req.request_id)     # no room in the draft's KV: plain decode
                continue
            self.kv.allocate(m, n)
            catch_up.append(ScheduledRequest(m, n, m.num_computed_tokens + n == m.num_tokens))
            budget -= n
            ks[m.request_id] = k
        drafts: dict[str, list[int]] = {}
        probs: dict[str, list[torch.Tensor]] = {}
        step = sorted(catch_up, key=lambda s: s.num_tokens > 1)   # decodes lead
        while step:
            logits = self.runner.logits(SchedulerOutput(step))
            sampling = [s.request for s in step if s.samples]
            tokens, q = self._draw(logits, sampling) if sampling else ([], [])
            for s in step:
                s.request.num_computed_tokens += s.num_tokens
            nxt = []
            for m, token, row in zip(sampling, tokens, q):
                d = drafts.setdefault(m.request_id, [])
                d.append(token)
                if row is not None:
                    probs.setdefault(m.request_id, []).append(row)
                if len(d) < ks[m.request_id]:
                    m.append_token(token, None)
                    self.kv.allocate(m, 1)
                    nxt.append(ScheduledRequest(m, 1, True))
                else:
                    m.append_token(token, None)      # kept: the next sync compares it
            step = nxt
        return drafts, {rid: torch.stack(rows) for rid, rows in probs.items()}

    def _draw(self, logits: torch.Tensor, requests: list[Request]
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        tokens = logits.argmax(dim=-1).tolist()
        q: list[torch.Tensor | None] = [None] * len(requests)
        for i, m in enumerate(requests):
            if not m.params.greedy:
                q[i] = self.sampler.probs(logits[i:i + 1].float(), [m])[0]
                noise = torch.empty_like(q[i]).exponential_(generator=self.sampler.generator(m))
                tokens[i] = int((q[i] / noise).argmax())
        return tokens, q
