"""Tool calls: tool_choice checked against the tools and turned into the output's grammar;
the model's own formats (Hermes <tool_call>, Llama 3.1 JSON) read back as OpenAI calls, whole
and streamed (content streams as it comes, each call as soon as it is complete); responses
and deltas in OpenAI's shape with the finish reason OpenAI gives; earlier calls in the history
rendered with parsed arguments."""
from __future__ import annotations

import json

import pytest

from pd_cluster.request import FinishReason
from pd_cluster.structured import GrammarKind
from router.errors import APIError
from router.protocol import ChatCompletionRequest, parse
from router.responses import Choice
from router.tool_calls import (AutoStreamer, ToolCallFormatter, ToolMode, parse_auto,
                               parse_required, with_parsed_arguments)

ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def chat(**body) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": MESSAGES, "tools": TOOLS, **body})


def test_a_named_function_constrains_the_output_to_its_arguments():
    req = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    grammar = req.sampling_params(16, None, 0).grammar
    assert req.tool_plan.mode is ToolMode.NAMED and grammar.kind is GrammarKind.JSON_SCHEMA
    assert json.loads(grammar.source) == ARGS


def test_required_constrains_to_a_list_of_calls_and_auto_to_nothing():
    grammar = chat(tool_choice="required").sampling_params(16, None, 0).grammar
    items = json.loads(grammar.source)["items"]["anyOf"]
    assert [i["properties"]["name"]["const"] for i in items] == ["get_weather", "get_time"]
    assert chat().tool_plan.mode is ToolMode.AUTO
    assert chat().sampling_params(16, None, 0).grammar is None
    assert chat(tool_choice="none").tool_plan.template_tools() is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": "required"}, "tools.function.parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.status == 400 and (e.value.param or "").startswith(param)


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')


def test_hermes_calls_are_parsed_and_the_rest_is_content():
    content, calls = parse_auto(HERMES)
    assert content == "Let me check.  Done."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_llama_json_calls_are_parsed():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", ' \
           '"parameters": {}}'
    content, calls = parse_auto(text)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse_auto('{"answer": 42}') == ('{"answer": 42}', [])
    assert parse_auto("Just text <tool") == ("Just text <tool", [])


def test_streamed_content_flows_and_each_call_comes_once_complete():
    streamer, content, seen = AutoStreamer(), "", []
    for i, ch in enumerate(HERMES):
        text, calls = streamer.feed(ch)
        content += text
        seen += [(i, c.name) for c in calls]
        assert "<" not in text
    rest, more = streamer.finish()
    assert content + rest == "Let me check.  Done." and not more
    closes = [i for i in range(len(HERMES)) if HERMES.startswith("</tool_call>", i)]
    assert seen == [(closes[0] + len("</tool_call>") - 1, "get_weather"),
                    (closes[1] + len("</tool_call>") - 1, "get_time")]


def formatter(mode: ToolMode) -> ToolCallFormatter:
    plan = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}
                if mode is ToolMode.NAMED else mode.value).tool_plan
    return ToolCallFormatter("chatcmpl-1", "default", None, None, plan)


def test_responses_carry_tool_calls_with_openai_finish_reasons():
    named = formatter(ToolMode.NAMED).whole_choice(
        Choice(0, '{"city": "Oslo"}', finish_reason=FinishReason.STOP))
    assert named["message"]["content"] is None and named["finish_reason"] == "stop"
    call = named["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    required = formatter(ToolMode.REQUIRED).whole_choice(Choice(
        0, '[{"name": "get_time", "parameters": {}}]', finish_reason=FinishReason.STOP))
    assert required["finish_reason"] == "tool_calls"
    assert required["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    auto = formatter(ToolMode.AUTO).whole_choice(Choice(0, "Hello!",
                                                        finish_reason=FinishReason.STOP))
    assert auto["message"] == {"role": "assistant", "content": "Hello!"}
    assert auto["finish_reason"] == "stop"
    assert parse_required('[{"name": "get_time", "param') == []   # cut short: no call


def test_named_deltas_stream_the_arguments():
    fmt = formatter(ToolMode.NAMED)
    parts = ['{"city"', ': "Os', 'lo"}']
    deltas = [fmt.delta_choice(0, p, [], [], FinishReason.STOP if i == 2 else None)
              for i, p in enumerate(parts)]
    first = deltas[0]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    args = "".join(d["delta"]["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert args == "".join(parts) and deltas[-1]["finish_reason"] == "stop"
    assert "content" not in deltas[1]["delta"]


def test_history_calls_are_rendered_with_parsed_arguments():
    msg = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert with_parsed_arguments(msg)["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Oslo"}
    req = parse(ChatCompletionRequest, {"messages": MESSAGES + [
        msg, {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]})
    assert [m.template_dict()["role"] for m in req.messages] == ["user", "assistant", "tool"]


def test_auto_deltas_hold_a_json_reply_until_it_is_a_call():
    fmt = formatter(ToolMode.AUTO)
    parts = ['{"name": "get_weather", ', '"parameters": {"city": ', '"Oslo"}}']
    deltas = [fmt.delta_choice(0, p, [], [], FinishReason.STOP if i == 2 else None)
              for i, p in enumerate(parts)]
    assert deltas[0]["delta"] == deltas[1]["delta"] == {}
    call = deltas[2]["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert deltas[2]["finish_reason"] == "tool_calls" and "content" not in deltas[2]["delta"]
    text = formatter(ToolMode.AUTO)
    plain = [text.delta_choice(0, p, [], [], None) for p in ["Hello", " there"]]
    assert [d["delta"] for d in plain] == [{"content": "Hello"}, {"content": " there"}]
