"""The single-process engine: requests in, streamed outputs out, one step at a time."""
from __future__ import annotations

import dataclasses
import itertools
import os
import time

from pd_cluster.config import DEFAULT_MODEL, EngineConfig, ModelConfig, resolve_max_model_len
from pd_cluster.kv_cache_manager import KVCacheManager
from pd_cluster.model_runner import LaunchedStep, ModelRunner, StepListener
from pd_cluster.output_processor import OutputProcessor
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import FinishReason, Request, RequestStatus
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, SchedulerStats
from pd_cluster.spec_decode.decoder import SpecStats
from pd_cluster.spec_decode.engine_hooks import build_spec_decoder
from pd_cluster.startup_heap import freeze_startup_heap
from pd_cluster.step_totals import StepWork, new_totals
from pd_cluster.structured.constraint import GrammarConstraint
from pd_cluster.structured.matcher import GrammarState, GrammarVocabulary
from pd_cluster.tokenizer import Tokenizer, load_tokenizer

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = config.model
        if model_dir == DEFAULT_MODEL:
            from pd_cluster.default_model import default_model_path
            model_dir = default_model_path()
        if config.load_format != "dummy" and not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model directory not found: {model_dir!r}")
        self.model_dir = model_dir
        self.model_cfg = ModelConfig.from_dir(model_dir)
        self.max_model_len = resolve_max_model_len(config, self.model_cfg)
        self.tokenizer: Tokenizer | None = load_tokenizer(model_dir)
        # Before the target's runner: on a GPU the draft model's share comes off the top.
        self.spec = (build_spec_decoder(config, self.max_model_len, self.model_cfg.vocab_size)
                     if config.speculative else None)
        self.runner = ModelRunner(config, model_dir, self.model_cfg, self.max_model_len,
                                  os.path.basename(os.path.normpath(model_dir)))
        if self.tokenizer is not None:
            self.runner.grammar = GrammarConstraint(GrammarVocabulary(
                self.tokenizer.hf, self.tokenizer.eos_token_ids, self.model_cfg.vocab_size))
        self.kv = KVCacheManager(self.runner.kv_layout.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # Steps by kind since start: count, seconds, work (pd_engine_* metrics). A step's
        # seconds are its step() call's: under async scheduling mostly the wait for the step
        # before it, the same length in a steady stream.
        self.step_totals = new_totals()
        self._in_flight: LaunchedStep | None = None   # launched, tokens not yet recorded
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        if self.runner.device.type == "cuda":
            self.warm_up()
            self.step_totals = new_totals()     # served steps only
            freeze_startup_heap()

    def warm_up(self) -> None:
        """Run a few throwaway requests through every kind of step serving will take, so
        that no kernel compiles mid-serving (about a second each, which a loaded engine
        turns into a queue): a full-budget prompt chunk, a 1-token prompt tail (which takes
        the decode path), prefills next to 1..4 decodes, decode-only batches. Leaves no
        blocks held, an empty prefix cache and zeroed counters."""
        budget = self.scheduler.max_num_batched_tokens
        vocab = self.model_cfg.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        # Each fits the context and half the KV cache (a small one, a short context).
        room = min(self.max_model_len, self.kv.num_blocks * self.config.block_size // 2) - 8
        lengths = [min(n, room) for n in (budget + 1, budget // 2 + 3, 33, 17, 5)]
        for n, length in enumerate(lengths):
            ids = [(7919 * i + n) % vocab for i in range(length)]
            self.add_request(ids, params, request_id=f"warm-up-{n}")
            self.step()
        while self.has_unfinished():
            self.step()
        self.kv.allocator.reset_prefix_cache()
        self.scheduler.stats = SchedulerStats()
        if self.spec is not None:
            self.spec.stats = SpecStats()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one); the engine is done."""
        self.runner.close()

    def dead_ranks(self) -> list[int]:
        """Tensor-parallel ranks whose process has exited (none with one rank)."""
        return self.runner.workers.dead() if self.runner.workers is not None else []

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    @property
    def kv_layout(self):
        return self.runner.kv_layout

    def kv_shards(self):
        """Every tensor-parallel rank's KV cache and layout, in rank order (pd_cluster/
        model_runner.py: ModelRunner.kv_shards)."""
        return self.runner.kv_shards()

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, hold_kv: bool = False,
                    arrival_time: float | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id.

        `hold_kv` (prefill side of disaggregation): stop after the first token but keep the
        request's KV blocks until `release(request_id)`. `arrival_time` (monotonic): when
        the request reached the engine's owner, if earlier than now (a request that arrives
        during a step is added after it, and that wait is the engine's).
        """
        req = self._new_request(prompt, params, request_id)
        req.hold_kv = hold_kv
        if arrival_time is not None:
            req.arrival_time = min(arrival_time, req.arrival_time)
        self.outputs.add(req)
        self.scheduler.add(req)
        return req.request_id

    def reserve(self, prompt: Prompt, params: SamplingParams | None = None,
                request_id: str | None = None) -> tuple[str, list[int], int] | None:
        """Decode side: take a request whose prompt KV another engine will write.

        Returns (request id, block ids for the whole prompt, prompt tokens already cached
        here), or None when the KV cache has no room for it now.
        """
        req = self._new_request(prompt, params, request_id)
        num_cached = self.scheduler.reserve(req)
        if num_cached is None:
            return None
        self.outputs.add(req)
        return req.request_id, list(req.block_ids), num_cached

    def resume(self, request_id: str, token: int,
               logprobs: dict[int, float] | None = None) -> RequestOutput:
        """Decode side: the reserved request's KV has landed; continue from its first token."""
        req = self.scheduler.resume(request_id, token, logprobs)
        self.runner.sampler.skip_draw(req, self.model_cfg.vocab_size)
        # Report it as a one-request step that sampled, so stop strings apply as usual.
        plan = SchedulerOutput([ScheduledRequest(req, 0, samples=True)])
        finished = [req] if req.is_finished else []
        return self.outputs.process(plan, finished, self.scheduler, self.runner.sampler)[0]

    def release(self, request_id: str) -> None:
        """Prefill side: the held request's KV has been sent; free its blocks."""
        self.scheduler.release(request_id)

    def _new_request(self, prompt: Prompt, params: SamplingParams | None,
                     request_id: str | None) -> Request:
        params = params or SamplingParams()
        token_ids = self._tokenize(prompt)
        vocab = self.model_cfg.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, leaving no room for output")
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room),
                                     min_tokens=min(params.min_tokens, room))
        need = self.kv.blocks_needed(len(token_ids) + params.max_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the KV cache has "
                             f"{self.kv.num_blocks}; lower max_tokens or enlarge the KV cache")
        if params.grammar is not None and self.tokenizer is None:
            raise ValueError(f"model {self.model_dir!r} has no tokenizer: a grammar-constrained "
                             f"request needs one")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        req = Request(request_id, token_ids, params, eos_token_ids=frozenset(eos))
        if params.grammar is not None:    # built now: a grammar it cannot use is refused
            req.grammar_state = GrammarState.start(self.runner.grammar.vocab, params.grammar)
            req.grammar_time = time.monotonic()   # a request trace's grammar.compile ends here
        return req

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_dir!r} has no tokenizer: pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its KV blocks are freed at once."""
        req = self.scheduler.finish(request_id, RequestStatus.ABORTED, FinishReason.ABORT)
        if req is None:
            return None
        req.drop_pending()
        if self.spec is not None:
            self.spec.retain(self.scheduler.requests)
        if not self.outputs.is_streaming(request_id):
            return None   # its stream already ended (a prefill side's held request)
        return self.outputs.finalize(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, listener: StepListener | None = None) -> list[RequestOutput]:
        """Plan and launch a step, then report the step before it.

        Async scheduling: the step launched here runs on the device while the host records
        the previous step's tokens, checks stops, builds outputs and (next call) plans again.
        A request that stopped in the previous step has one wasted token computed in this one;
        its blocks return to the allocator once that write is done. A step watched by a listener
        (the prefill side, which pushes KV per layer) is reported before returning.
        """
        began = time.perf_counter()
        outputs, drafts, draft_probs = [], {}, {}
        if (self.spec is not None and listener is None
                and self.spec.wants_step(self.scheduler.running)):
            # Proposals need every sequence's last token: collect the step in flight first.
            if self._in_flight is not None:
                outputs = self._report(self._in_flight)
                self._in_flight = None
            drafts, draft_probs = self.spec.propose(self.scheduler.running)
        plan = self.scheduler.schedule(drafts) if drafts else self.scheduler.schedule()
        launched, work = None, None
        if not plan.is_empty:
            work = StepWork.of(plan)
            launched = self.runner.execute(plan, listener, self._in_flight, draft_probs)
            self.kv.step_launched([s.request.request_id for s in plan.scheduled])
        outputs += self._report(self._in_flight) if self._in_flight else []
        self._in_flight = None
        if launched is not None:
            self.scheduler.advance(plan)
            self._in_flight = launched
            if listener is not None or not self.async_scheduling or launched.emitted:
                outputs += self._report(launched)
                self._in_flight = None
            self.step_totals[work.kind.value].add(work, time.perf_counter() - began)
        return outputs

    def _report(self, step: LaunchedStep) -> list[RequestOutput]:
        sampled = step.result()
        self.kv.step_done([s.request.request_id for s in step.plan.scheduled])
        # Requests that ended after this step was planned (a stop found one step late, an
        # abort) have had their last output already: their token here is dropped.
        live = [s for s in step.plan.scheduled if s.samples and not s.request.is_finished]
        more = {rid: tokens[1:] for rid, tokens in step.emitted.items()}
        if step.emitted:
            self.spec.observe({s.request.request_id: s.draft for s in step.plan.scheduled
                               if s.draft}, step.emitted, self.scheduler.requests)
        finished = self.scheduler.record(step.plan, sampled, more)
        if self.spec is not None and finished:
            self.spec.retain(self.scheduler.requests)
        return self.outputs.process(SchedulerOutput(live), finished, self.scheduler,
                                    self.runner.sampler)
