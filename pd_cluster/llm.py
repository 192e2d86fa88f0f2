"""The offline API: `LLM(model).generate(prompts, params)` and `LLM(model).chat(messages)`."""
from __future__ import annotations

import weakref
from typing import Sequence

from tqdm.auto import tqdm

from pd_cluster.config import DEFAULT_MODEL, EngineConfig
from pd_cluster.engine import LLMEngine, Prompt
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """Runs a model in this process. `LLM()` loads the bundled default model.

    Keyword arguments are `EngineConfig` fields, e.g. `LLM(path, block_size=32, dtype="bfloat16")`;
    an unknown one or a bad value is a ValueError naming it.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig.of(model=DEFAULT_MODEL if model is None else model,
                                                **kwargs))
        # A dropped LLM closes its engine, so the process can build the next one (a
        # tensor-parallel engine holds the process's group until it is closed).
        self._closer = weakref.finalize(self, self.engine.close)

    def close(self) -> None:
        """Stop the engine's other ranks (`tensor_parallel_size` > 1); also on `with` exit
        and when this LLM is garbage-collected."""
        self._closer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:  # on an exception, leave no request holding KV blocks
                if rid not in finished:
                    self.engine.abort(rid)
        return [finished[rid] for rid in ids]
