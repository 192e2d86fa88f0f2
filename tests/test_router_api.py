"""The router's HTTP layer in-process, over a scripted EngineClient: OpenAI error bodies and
status codes (auth, malformed JSON, unknown model, bad values, limits, oversized bodies,
unknown routes, engine refusals and crashes), the bounded queue's 429, response shapes with
n > 1, logprobs and usage, and SSE framing."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient

from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.role import Role
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tokenizer import load_tokenizer
from router.api import Router, create_app
from router.app_config import AppConfig
from router.metrics import RouterMetrics
from router.routing import ReplicaLoad, Route, RoutingInputs, make_policy
from router.serving import OpenAIServing
from router.streams import LoadMonitor

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
        self.tokenizer = None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, route: Route) -> AsyncIterator[RequestOutput]:
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


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: str):
    return load_tokenizer(default_model_dir)


def make_client(tokenizer, **args) -> tuple[TestClient, ScriptedClient]:
    config = AppConfig.from_args({"mode": "colocated", "api_key_env": "PD_KEY",
                                  "engine": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 2},
                                  "limits": {"max_tokens": 32, "max_queue": 1}, **args})
    engine = ScriptedClient()
    engine.tokenizer = tokenizer
    metrics = RouterMetrics(config.engine.model)
    policy = make_policy("kv_aware", RoutingInputs(0, 1, config.engine.block_size))
    serving = OpenAIServing(config, engine, policy, tokenizer, MAX_MODEL_LEN, metrics)
    router = Router(serving, LoadMonitor(engine, policy, metrics), None, KEY)
    return TestClient(create_app(router), raise_server_exceptions=False), engine


@pytest.fixture(scope="module")
def api(tokenizer):
    client, engine = make_client(tokenizer)
    with client:
        yield client, engine


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def complete(client: TestClient, **body):
    return client.post("/v1/completions", headers=AUTH,
                       json={"model": "default", "prompt": "Hi", **body})


def test_api_key_is_required_on_v1_routes_only(api):
    client, _ = api
    assert error_of(client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    bad = client.post("/v1/completions", json={"prompt": "Hi"},
                      headers={"Authorization": "Bearer nope"})
    assert error_of(bad, 401)["type"] == "authentication_error"
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "default"
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "Hi", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "Hi", "max_tokens": 33}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "word " * 80}, 400, "prompt"),
    ({"prompt": "Hi " * 40, "max_tokens": 30}, 400, "max_tokens"),
    ({"prompt": [99999999]}, 400, "prompt"),
    ({"prompt": "Hi", "n": 0}, 400, "n"),
    ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(api, body, status, param):
    client, _ = api
    response = client.post("/v1/completions", headers=AUTH, json=body)
    assert error_of(response, status)["param"] == param


def test_malformed_oversized_and_misrouted_requests(api):
    client, _ = api
    malformed = client.post("/v1/chat/completions", headers={**AUTH, "Content-Type":
                            "application/json"}, content=b'{"messages": [')
    assert error_of(malformed, 400)["code"] == "invalid_json"
    assert error_of(client.post("/v1/completions", headers=AUTH, json=[1, 2]), 400)
    huge = client.post("/v1/completions", headers=AUTH,
                       content=b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert error_of(huge, 413)["code"] == "request_too_large"
    assert error_of(client.get("/v1/nothing", headers=AUTH), 404)
    assert error_of(client.get("/v1/completions", headers=AUTH), 405)
    no_messages = client.post("/v1/chat/completions", headers=AUTH, json={"messages": []})
    assert error_of(no_messages, 400)["param"] == "messages"


def test_engine_refusal_is_400_and_crash_is_500_and_serving_goes_on(api):
    client, _ = api
    assert "KV blocks" in error_of(complete(client, prompt="refuse"), 400)["message"]
    assert error_of(complete(client, prompt="crash"), 500)["type"] == "server_error"
    assert complete(client).status_code == 200


def test_completion_with_n_logprobs_and_usage(api, tokenizer):
    client, _ = api
    body = complete(client, n=2, max_tokens=3, logprobs=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == " one two three"
    lp = body["choices"][1]["logprobs"]
    assert lp["token_logprobs"] == [-0.5] * 3 and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"][0] == 0
    prompt_tokens = len(tokenizer.encode("Hi"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6,
                             "total_tokens": prompt_tokens + 6,
                             "prompt_tokens_details": {"cached_tokens": 3}}


def test_chat_logprobs_shape(api):
    client, _ = api
    body = client.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 1}).json()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " one two"}
    entry = choice["logprobs"]["content"][0]
    assert entry["logprob"] == -0.5 and len(entry["top_logprobs"]) == 1
    assert body["object"] == "chat.completion"


def sse_events(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_chat_stream_framing_and_usage_chunk(api):
    client, _ = api
    with client.stream("POST", "/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant",
                                                               "content": ""}] * 2
    text = {0: "", 1: ""}
    for e in events[2:-1]:
        text[e["choices"][0]["index"]] += e["choices"][0]["delta"].get("content", "")
    assert text == {0: " one two three", 1: " one two three"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


def test_full_queue_answers_429_with_retry_after(tokenizer):
    # Capacity: 2 running slots (max_num_seqs) + 1 queue place; a request with n=3 fills it.
    client, engine = make_client(tokenizer)
    with client:
        with client.stream("POST", "/v1/completions", headers=AUTH, json={
                "prompt": "slow", "n": 3, "max_tokens": 2, "stream": True}) as held:
            refused = complete(client)
            assert error_of(refused, 429)["type"] == "rate_limit_error"
            assert refused.headers["retry-after"] == "1"
            client.portal.call(engine.release.set)
            assert sse_events(held)[-1]["choices"][0]["finish_reason"] == "length"
        assert complete(client).status_code == 200


def test_request_over_its_time_limit_is_aborted_with_504(tokenizer):
    client, engine = make_client(tokenizer, limits={"max_tokens": 32, "request_timeout_s": 0.5})
    with client:
        late = complete(client, prompt="slow", max_tokens=3)
        assert error_of(late, 504)["type"] == "timeout_error"
        assert not engine.active        # the engine request was cancelled, not left running
        assert complete(client).status_code == 200
