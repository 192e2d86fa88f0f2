"""One OpenAI request, end to end in the router:

    parse → check model → tokenize (chat template) and check lengths → admit (or 429)
      → one engine request per prompt × choice, each routed by the policy
      → merged output streams → SSE chunks or one JSON body (usage, logprobs)

Any early exit — error, timeout, client gone (the handler is cancelled) — closes the merged
stream, which aborts every engine request still running, so their KV blocks are freed.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pd_cluster.outputs import RequestOutput
from pd_cluster.request import FinishReason
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tokenizer import Tokenizer
from router import tenants
from router.app_config import AppConfig
from router.engine_client import EngineClient
from router.errors import (APIError, EngineUnavailable, ErrorCode, bad_request, internal,
                           model_not_found, timed_out, unavailable)
from router.metrics import RouterMetrics
from router.protocol import ChatCompletionRequest, CompletionRequest, parse
from router.responses import (ChatFormatter, Choice, CompletionFormatter, Formatter, sse,
                              usage)
from router.routing import RoutingPolicy
from router.streams import Admission, merge
from router.tool_calls import ToolCallFormatter, ToolMode
from router.tracing import CURRENT, Tracing, traced

logger = logging.getLogger(__name__)
Body = dict[str, Any] | AsyncIterator[str]   # a JSON body, or SSE events to stream


@dataclass(slots=True)
class Job:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class OpenAIServing:
    def __init__(self, config: AppConfig, client: EngineClient, policy: RoutingPolicy,
                 tokenizer: Tokenizer, max_model_len: int, metrics: RouterMetrics) -> None:
        self.config, self.client, self.policy = config, client, policy
        self.tokenizer, self.max_model_len, self.metrics = tokenizer, max_model_len, metrics
        self.max_prompt_tokens = config.limits.max_prompt_tokens or max_model_len - 1
        self.admission = Admission(config.num_decode * config.engine.max_num_seqs,
                                   config.limits.max_queue, metrics)
        self.tracing: Tracing | None = None     # request traces, when on (router/tracing.py)

    async def completions(self, body: Any, headers: Mapping[str, str] | None = None) -> Body:
        """POST /v1/completions; `headers`: the request's (a W3C traceparent, when traced)."""
        return await traced(self.tracing, "text_completion", self.config.engine.model, headers,
                            self._completions(body))

    async def chat(self, body: Any, headers: Mapping[str, str] | None = None) -> Body:
        """POST /v1/chat/completions; `headers` as for completions."""
        return await traced(self.tracing, "chat", self.config.engine.model, headers,
                            self._chat(body))

    async def _completions(self, body: Any) -> Body:
        req: CompletionRequest = parse(CompletionRequest, body)
        self.check_model(req.model)
        prompts = [self._prompt_ids(p) for p in req.prompts()]
        fmt = CompletionFormatter(f"cmpl-{uuid.uuid4().hex}", self.config.engine.model,
                                  self.tokenizer, req.logprobs)
        return await self._serve(req, prompts, req.max_tokens, req.logprobs, fmt)

    async def _chat(self, body: Any) -> Body:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        self.check_model(req.model)
        try:
            ids = self.tokenizer.apply_chat_template([m.template_dict() for m in req.messages],
                                                     tools=req.tool_plan.template_tools())
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise bad_request(f"messages: cannot apply the chat template: {e}",
                              param="messages") from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        fmt = ChatFormatter(f"chatcmpl-{uuid.uuid4().hex}", self.config.engine.model,
                            self.tokenizer, top)
        if req.tool_plan.mode is not ToolMode.NONE:
            fmt = ToolCallFormatter(fmt.request_id, fmt.model, self.tokenizer, top,
                                    req.tool_plan)
        return await self._serve(req, [self._check_length(ids)], req.requested_max_tokens,
                                 top, fmt)

    def check_available(self) -> None:
        """503 when no decode replica can take requests (the engines are starting, or every
        decode replica is restarting)."""
        if not any(role == Role.DECODE for role, _ in self.client.available()):
            raise unavailable("No engine replica is ready to serve: the engines are starting "
                              "or restarting (GET /health says which replicas and why).")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.engine.model:
            raise model_not_found(model)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise bad_request(f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        return self._check_length(ids)

    def _check_length(self, ids: list[int]) -> list[int]:
        if not ids:
            raise bad_request("prompt: must not be empty", param="prompt")
        if len(ids) > self.max_prompt_tokens:
            raise bad_request(f"This model's maximum prompt length is {self.max_prompt_tokens} "
                              f"tokens; the prompt has {len(ids)}.", param="prompt",
                              code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        return ids

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        room, limit = self.max_model_len - prompt_len, self.config.limits.max_tokens
        if requested is None:
            return max(1, min(limit, room))
        if requested > limit:
            raise bad_request(f"max_tokens: {requested} exceeds this server's limit of {limit}",
                              param="max_tokens", code=ErrorCode.INVALID_VALUE)
        if requested > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens; the prompt has {prompt_len} and max_tokens is "
                              f"{requested}.", param="max_tokens",
                              code=ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        return requested

    def _jobs(self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
              max_tokens: int | None, logprobs: int | None, request_id: str,
              tenant: tenants.Tenant | None) -> list[Job]:
        jobs = []
        for p, ids in enumerate(prompts):
            budget = self._max_tokens(max_tokens, len(ids))
            for i in range(req.n):
                index = p * req.n + i
                try:
                    params = req.sampling_params(budget, logprobs, i,
                                                 None if tenant is None else tenant.salt)
                except ValueError as e:
                    raise bad_request(str(e)) from None
                jobs.append(Job(index, p, f"{request_id}-{index}", ids, params))
        return jobs

    async def _serve(self, req: CompletionRequest | ChatCompletionRequest,
                     prompts: list[list[int]], max_tokens: int | None, logprobs: int | None,
                     fmt: Formatter) -> Body:
        req.check_token_ids(self.tokenizer.vocab_size)
        tenant = tenants.CURRENT.get()      # set by the API's auth (None: no tenants)
        jobs = self._jobs(req, prompts, max_tokens, logprobs, fmt.request_id, tenant)
        self.check_available()
        if tenant is not None:              # 429 past its own limits
            tenant.admit(sum(len(job.prompt_ids) + job.params.max_tokens for job in jobs))
        trace = None if self.tracing is None else CURRENT.get()
        if trace is not None:
            trace.request(**{"gen_ai.response.id": fmt.request_id, "gen_ai.request.max_tokens":
                             max_tokens, "gen_ai.request.temperature": req.temperature,
                             "gen_ai.request.top_p": req.top_p, "gen_ai.request.choice.count":
                             req.n, "pd.stream": bool(req.stream)})
        self.metrics.prompt_tokens.inc(sum(map(len, prompts)))
        self.admission.acquire(len(jobs))
        outputs = self._outputs(jobs)
        try:
            first = await self._next(outputs)
        except BaseException:
            await outputs.aclose()
            raise
        run = _Run(self, jobs, fmt, outputs, first, req.include_usage)
        return run.events() if req.stream else await run.collect()

    async def _outputs(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All jobs' outputs; closing it (or its garbage collection) ends them all and gives
        their admission places back."""
        try:
            streams = [self._run(job) for job in jobs]
            async with aclosing(merge(streams, self.config.limits.request_timeout_s)) as merged:
                async for item in merged:
                    yield item
        finally:
            self.admission.release(len(jobs))

    async def _run(self, job: Job) -> AsyncIterator[RequestOutput]:
        trace = None if self.tracing is None else CURRENT.get()
        routing = time.monotonic()
        route = self.policy.route(job.prompt_ids, job.params.cache_salt)
        if trace is not None:
            trace.job(job.request_id).routed(routing, time.monotonic(), route.prefill_id,
                                             route.decode_id)
        if self.config.num_prefill:
            self.metrics.decisions.labels("local" if route.prefill_id is None else "remote").inc()
        timer = self.metrics.timer(len(job.prompt_ids))
        async for out in self.client.generate(job.request_id, job.prompt_ids, job.params,
                                              route):
            timer.output()
            if out.finished:
                choice = out.outputs[0]
                if choice.finish_reason is FinishReason.ERROR:
                    raise RuntimeError(f"engine failed the request: {out.error}")
                timer.finish(choice.finish_reason or FinishReason.STOP, len(choice.token_ids))
                if trace is not None:
                    trace.job(job.request_id).done(job.prompt_index, len(job.prompt_ids),
                                                   len(choice.token_ids), choice.finish_reason)
            yield out

    async def _next(self, outputs: AsyncIterator[tuple[int, RequestOutput]]
                    ) -> tuple[int, RequestOutput] | None:
        """The next (job index, output), None at the end; failures become APIErrors."""
        try:
            return await anext(outputs)
        except StopAsyncIteration:
            return None
        except Exception as e:  # noqa: BLE001 - every failure is answered in OpenAI's schema
            raise self.as_api_error(e) from None

    def as_api_error(self, e: Exception) -> APIError:
        cause = getattr(e, "cause", None) or e      # a RayTaskError wraps the actor's error
        if isinstance(e, APIError):
            return e
        if isinstance(e, ValueError):               # the engine refused the request
            return bad_request(str(cause))
        if isinstance(e, TimeoutError):
            return timed_out(self.config.limits.request_timeout_s)
        if isinstance(e, (EngineUnavailable, LookupError)):   # LookupError: NoReplicaAvailable
            return unavailable(f"no engine replica can serve the request: {cause}")
        logger.error("request failed: %r", e)
        return internal(f"the request failed: {cause!r}")


class _Run:
    """Turns a request's merged outputs into SSE events or one response body."""

    def __init__(self, serving: OpenAIServing, jobs: list[Job], fmt: Formatter,
                 outputs: AsyncIterator[tuple[int, RequestOutput]],
                 first: tuple[int, RequestOutput] | None, include_usage: bool) -> None:
        self.serving, self.jobs, self.fmt, self.outputs = serving, jobs, fmt, outputs
        self.first, self.include_usage = first, include_usage
        self.choices = [Choice(job.index) for job in jobs]
        self.cached = [0] * len(jobs)
        self.spec = [(0, 0)] * len(jobs)       # draft tokens (proposed, accepted) per choice
        self.engine_ttft: float | None = None   # of the first output that carried one

    async def _items(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        item = self.first
        while item is not None:
            yield item
            item = await self.serving._next(self.outputs)

    def _update(self, i: int, out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
        """Record a choice's latest output; returns its new token ids and their logprobs."""
        choice, done = self.choices[i], out.outputs[0]
        sent = len(choice.token_ids)
        choice.text, choice.token_ids = done.text, list(done.token_ids)
        choice.logprobs = list(done.logprobs or [])
        choice.finish_reason = done.finish_reason if out.finished else None
        self.cached[i] = out.num_cached_tokens
        self.spec[i] = (out.spec_proposed_tokens, out.spec_accepted_tokens)
        if self.engine_ttft is None:
            self.engine_ttft = out.engine_ttft
        return choice.token_ids[sent:], choice.logprobs[sent:]

    def usage(self) -> dict[str, Any]:
        n = len(self.jobs) // len({job.prompt_index for job in self.jobs})
        firsts = [job for job in self.jobs if job.index % n == 0]  # the prompt counts once
        return usage(sum(len(job.prompt_ids) for job in firsts),
                     sum(len(c.token_ids) for c in self.choices),
                     sum(self.cached[job.index] for job in firsts),
                     sum(p for p, _ in self.spec), sum(a for _, a in self.spec))

    async def collect(self) -> dict[str, Any]:
        try:
            async for i, out in self._items():
                self._update(i, out)
        except asyncio.CancelledError:
            self.serving.metrics.errors.labels(ErrorCode.CLIENT_DISCONNECTED).inc()
            raise
        finally:
            await self.outputs.aclose()
        return self.fmt.response(self.choices, self.usage())

    async def events(self) -> AsyncIterator[str]:
        try:
            for chunk in self.fmt.opening_chunks(len(self.jobs)):
                yield sse(chunk)
            async for i, out in self._items():
                ids, lps = self._update(i, out)
                reason = self.choices[i].finish_reason
                if out.delta_text or reason or (ids and self.fmt.top_logprobs is not None):
                    yield sse(self.fmt.chunk(i, out.delta_text, ids, lps, reason))
            if self.include_usage:
                yield sse(self.fmt.usage_chunk(self.usage(), self.engine_ttft))
        except (asyncio.CancelledError, GeneratorExit):   # the client went away mid-stream
            self.serving.metrics.errors.labels(ErrorCode.CLIENT_DISCONNECTED).inc()
            raise
        except APIError as e:     # after the 200 went out: the error travels as an event
            self.serving.metrics.errors.labels(e.kind).inc()
            yield sse(e.body())
        finally:
            await self.outputs.aclose()
        yield sse("[DONE]")
