"""Fields we do not honour are refused, never silently ignored; text that UTF-8 cannot encode
(a lone surrogate, valid JSON) is a 400 naming the field, not a tokenizer crash (500)."""
from __future__ import annotations

import importlib
import json

import pytest

from router import protocol
from tests.support.scripted_router import AUTH, error_of, make_client

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
PROMPT = {"prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def client(tokenizer):  # noqa: F811
    client, _ = make_client(tokenizer)
    with client:
        yield client


def post(client, path: str, body: dict, **extra):
    return client.post(path, headers=AUTH, json={**body, **extra})


REFUSED = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("guided_grammar", "root ::= 'x'"),
    ("guided_decoding_backend", "xgrammar"),
    ("best_of", 2),
    ("suffix", "end"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("verbosity", "low"),
    ("moderation", {"input": {"mode": "block"}}),
    ("use_beam_search", True),
    ("reasoning_effort", "high"),
]


@pytest.mark.parametrize("path, body", [("/v1/completions", PROMPT),
                                        ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("field, value", REFUSED)
def test_unhonoured_fields_are_refused_naming_the_field(client, path, body, field, value):
    error = error_of(post(client, path, body, **{field: value}), 400)
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_value"


# Tool calls are honoured on chat (tests/router/test_tool_calls.py), refused on completions; on chat
# every call may be parallel: asking for none is refused.
@pytest.mark.parametrize("path, body, field, value", [
    ("/v1/completions", PROMPT, "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/completions", PROMPT, "tool_choice", "auto"),
    ("/v1/completions", PROMPT, "tool_choice", "required"),
    ("/v1/completions", PROMPT, "parallel_tool_calls", True),
    ("/v1/chat/completions", CHAT, "parallel_tool_calls", False),
])
def test_tool_fields_are_refused_where_not_honoured(client, path, body, field, value):
    error = error_of(post(client, path, body, **{field: value}), 400)
    assert error["param"] == field and field in error["message"]
    assert error["code"] == "unsupported_value"


@pytest.mark.parametrize("path, body", [("/v1/completions", PROMPT),
                                        ("/v1/chat/completions", CHAT)])
def test_unknown_fields_are_refused(client, path, body):
    for field in ["stop_token_ids", "chat_template_kwargs", "made_up"]:
        error = error_of(post(client, path, body, **{field: 1}), 400)
        assert error["param"] == field and error["code"] == "unknown_parameter"
        assert error["message"] == f"Unrecognized request argument supplied: {field}"


HARMLESS = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "seed": 7, "stream_options": None, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none", "presence_penalty": 0, "frequency_penalty": 0.0,
            "repetition_penalty": 1, "logit_bias": {}, "best_of": 1, "modalities": ["text"],
            "functions": [], "function_call": "none", "guided_json": None, "suffix": None,
            "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
            "verbosity": None, "min_p": 0.05}


@pytest.mark.parametrize("path, body", [("/v1/completions", PROMPT),
                                        ("/v1/chat/completions", CHAT)])
def test_harmless_fields_and_neutral_values_are_accepted(client, path, body):
    response = post(client, path, body, **HARMLESS)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_value_refusals_name_their_field(client):
    echo = error_of(post(client, "/v1/completions", PROMPT, echo=True), 400)
    assert echo["param"] == "echo" and echo["code"] == "unsupported_value"
    assert error_of(post(client, "/v1/completions", {"prompt": []}), 400)["param"] == "prompt"
    top = post(client, "/v1/chat/completions", CHAT, top_logprobs=2)
    assert error_of(top, 400)["param"] == "top_logprobs"


def test_non_text_content_parts_and_nested_options_are_refused(client):
    image = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert error_of(post(client, "/v1/chat/completions", image), 400)["param"] == \
        "messages.0.content"
    no_text = {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}
    assert error_of(post(client, "/v1/chat/completions", no_text), 400)["param"] == \
        "messages.0.content"
    options = post(client, "/v1/completions", PROMPT,
                   stream=True, stream_options={"include_usage": True, "other": 1})
    assert error_of(options, 400)["param"] == "stream_options.other"


def raw(client, path: str, text: str):
    """POST a JSON text as is: json= would not let a lone surrogate escape through."""
    return client.post(path, headers={**AUTH, "Content-Type": "application/json"},
                       content=text.encode())


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", '{"prompt": "Hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff x"]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/completions", '{"prompt": "Hi", "stop": "\\ud83d"}', "stop"),
    ("/v1/completions", '{"prompt": "Hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "Hi", "user": "\\ud800"}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "Hi", "name": "\\ud800"}]}',
     "messages.0.name"),
])
def test_lone_surrogates_are_400_naming_the_field(client, path, text, param):
    json.loads(text)   # valid JSON
    error = error_of(raw(client, path, text), 400)
    assert error["param"] == param and "Unicode" in error["message"]


def test_surrogate_in_a_key_and_deep_nesting_are_400(client):
    error = error_of(raw(client, "/v1/completions", '{"prompt": "Hi", "\\ud800": 1}'), 400)
    assert error["param"] == "\\ud800"
    deep = '{"prompt": "Hi", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert error_of(raw(client, "/v1/completions", deep), 400)["code"] == "invalid_json"
    # A valid pair is fine, escaped or not.
    ok = raw(client, "/v1/completions", '{"prompt": "Hi \\ud83d\\ude00 😀", "max_tokens": 2}')
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("top_p", "Infinity"),
                                          ("temperature", "1e999"), ("seed", str(2 ** 70)),
                                          ("top_k", str(2 ** 64)), ("max_tokens", "1e308"),
                                          ("n", "-Infinity")])
def test_extreme_numbers_are_400(client, field, value):
    text = '{"prompt": "Hi", "%s": %s}' % (field, value)
    assert error_of(raw(client, "/v1/completions", text), 400)["param"] == field


@pytest.mark.parametrize("params, request_model", [
    ("completion_create_params", protocol.CompletionRequest),
    ("chat.completion_create_params", protocol.ChatCompletionRequest)])
def test_every_openai_field_is_honoured_accepted_or_refused_by_name(params, request_model):
    """No field of the official client's request types falls through to "Unrecognized
    request argument" (which would call an OpenAI field unknown)."""
    module = importlib.import_module(f"openai.types.{params}")
    fields = set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}
    ruled = set(request_model.model_fields) | protocol.HARMLESS | set(protocol.NEUTRAL)
    missing = fields - ruled
    assert not missing, f"OpenAI fields with no rule in router/protocol.py: {sorted(missing)}"
    options = importlib.import_module("openai.types.chat.chat_completion_stream_options_param")
    assert set(options.ChatCompletionStreamOptionsParam.__annotations__) <= \
        set(protocol.StreamOptions.model_fields)


def test_stream_obfuscation_is_refused_unless_off(client):
    off = post(client, "/v1/chat/completions", CHAT, stream=True,
               stream_options={"include_usage": True, "include_obfuscation": False})
    assert off.status_code == 200, off.text
    on = post(client, "/v1/chat/completions", CHAT, stream=True,
              stream_options={"include_obfuscation": True})
    assert error_of(on, 400)["param"] == "stream_options.include_obfuscation"
