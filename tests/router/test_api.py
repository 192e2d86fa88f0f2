"""The router's HTTP layer in-process, over a scripted EngineClient: OpenAI error bodies and
status codes (auth, malformed JSON, unknown model, bad values, limits, oversized bodies,
unknown routes, engine refusals and crashes), the bounded queue's 429, response shapes with
n > 1, logprobs and usage, and SSE framing."""
from __future__ import annotations

import json

import pytest

from tests.support.scripted_router import AUTH, complete, make_client
from tests.support.scripted_router import error_of


@pytest.fixture(scope="module")
def api(tokenizer):
    client, engine = make_client(tokenizer)
    with client:
        yield client, engine


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
