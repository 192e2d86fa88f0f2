"""The router's HTTP app in-process over a scripted EngineClient (no engine, no Ray)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.testclient import TestClient

from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from router.api import Router, create_app
from router.app_config import AppConfig
from router.metrics import RouterMetrics
from router.routing import ReplicaLoad, Route, RoutingInputs, make_policy
from router.serving import OpenAIServing
from router.streams import LoadMonitor
from router.tenants import Tenants

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64
WORDS = [" one", " two", " three", " four", " five", " six", " seven", " eight"]


class ScriptedClient:
    """An EngineClient whose engine writes WORDS; prompts starting "slow" wait for `release`,
    "refuse" raise ValueError as an engine would, "crash" raise RuntimeError."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.params: list[SamplingParams] = []      # every request's, in arrival order
        self.tokenizer = None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, route: Route) -> AsyncIterator[RequestOutput]:
        self.params.append(params)
        prompt = self.tokenizer.decode(prompt_token_ids)
        if "refuse" in prompt:
            raise ValueError("request needs 999 KV blocks but the pool has 10")
        if "crash" in prompt:
            raise RuntimeError("engine fell over")
        self.active.add(request_id)
        try:
            ids, lps, text = [], [], ""
            for i in range(params.max_tokens):
                if "slow" in prompt and i > 0:   # the first token comes at once
                    await asyncio.wait_for(self.release.wait(), 10)
                ids.append(1000 + i)
                lps.append({1000 + i: -0.5, 2000: -1.5, 3000: -2.5})
                text += WORDS[i % len(WORDS)]
                done = i + 1 == params.max_tokens
                out = CompletionOutput(0, text, list(ids), list(lps) if params.logprobs
                                       is not None else None, "length" if done else None)
                yield RequestOutput(request_id, prompt_token_ids, [out], done, 3,
                                    WORDS[i % len(WORDS)], [ids[-1]])
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def available(self) -> set[tuple[str, int]]:
        return {(Role.DECODE, 0)}

    async def loads(self, cursors=None) -> list[ReplicaLoad]:
        return [ReplicaLoad(Role.DECODE, 0, num_running=len(self.active), kv_blocks_total=10)]


def make_client(tokenizer, **args) -> tuple[TestClient, ScriptedClient]:
    auth = {} if "tenants" in args else {"api_key_env": "PD_KEY"}
    config = AppConfig.from_args({"mode": "colocated", **auth,
                                  "engine": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 2},
                                  "limits": {"max_tokens": 32, "max_queue": 1}, **args})
    engine = ScriptedClient()
    engine.tokenizer = tokenizer
    metrics = RouterMetrics(config.engine.model)
    policy = make_policy("kv_aware", RoutingInputs(0, 1, config.engine.block_size))
    serving = OpenAIServing(config, engine, policy, tokenizer, MAX_MODEL_LEN, metrics)
    who = (Tenants.from_config(config.tenants, config.router_replicas) if config.tenants
           else Tenants.single(KEY))
    router = Router(serving, LoadMonitor(engine, policy, metrics), None, who)
    return TestClient(create_app(router), raise_server_exceptions=False), engine


def complete(client: TestClient, **body):
    return client.post("/v1/completions", headers=AUTH,
                       json={"model": "default", "prompt": "Hi", **body})


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error
