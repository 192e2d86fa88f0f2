"""Structured output and tool calls through the real `serve run configs/pd.yaml`
(disaggregated, 1 P + 1 D, the bundled SmolLM2-135M-Instruct), driven with the official openai
client: 10 chats under a json_schema response format and 10 under json_object (20 names between
them), every one that stops parses (and validates) and at least 9 of 10 stop within 256 tokens;
a named tool_choice always yields a call of that function whose arguments validate; both
stream (and
tool_choice "required"); vLLM's
guided_choice / guided_regex on completions; an invalid schema is a 400 naming the field.

The server is the session's shared default application (conftest.py); each batch of 10 runs
concurrently (one decode batch). A batch's time grows with its requests, not its tokens
(each stops within ~40): the engines' grammar work per sequence and step, on 2 cores.
"""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

pytest.importorskip("ray")
from tests.support.serve_run import API_KEY  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]
MAX_TOKENS = 256
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jin",
         "Kofi", "Lena", "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara"]
BATCH = 10                     # chats of one batch: each batch takes its own half of NAMES
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string"}}}
WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 40},
                               "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "The current weather in a city.",
                                            "parameters": WEATHER_ARGS}}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def server(default_server: str) -> str:
    """The session's shared default application (conftest.py), API_KEY required."""
    return default_server


class Client:
    """An AsyncOpenAI client for each `run` (its connections belong to that event loop)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def run(self, calls):
        """The results of `calls(client)` (a list of coroutines), run concurrently."""
        async def go():
            async with openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY,
                                          max_retries=0, timeout=600) as client:
                return await asyncio.gather(*calls(client))
        return asyncio.run(go())


@pytest.fixture(scope="module")
def client(server: str) -> Client:
    return Client(server)


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe a person called {name} as JSON: "
                                        f"name, age and city."}]


def weather(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather like in {city} today?"}]


def chats(client: Client, half: int, messages=ask, **kw) -> list:
    """A batch of BATCH chats, one per name of NAMES' first (0) or second (1) half."""
    return client.run(lambda c: [c.chat.completions.create(
        model="default", messages=messages(n), max_tokens=MAX_TOKENS, temperature=0, **kw)
        for n in NAMES[half * BATCH:(half + 1) * BATCH]])


def check_batch(responses: list, schema: dict | None, what: str) -> int:
    stopped = 0
    for r in responses:
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            value = json.loads(choice.message.content)
            jsonschema.validate(value, schema or {"type": "object"})
            stopped += 1
    print(f"{what}: {stopped}/{len(responses)} stopped within {MAX_TOKENS} tokens")
    assert stopped >= BATCH - 1
    return stopped


def test_json_schema_responses_validate(client):
    check_batch(chats(client, 0, response_format=PERSON_FORMAT), PERSON, "json_schema")


def test_json_object_responses_parse(client):
    check_batch(chats(client, 1, response_format={"type": "json_object"}), None, "json_object")


def test_a_named_tool_choice_always_yields_a_valid_call(client):
    responses = chats(client, 0, weather, tools=[WEATHER],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for r in responses:
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg
        assert msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)


def stream(client: Client, **kw) -> list:
    async def chunks(c):
        return [chunk async for chunk in await c.chat.completions.create(
            model="default", max_tokens=MAX_TOKENS, temperature=0, stream=True, **kw)]
    return client.run(lambda c: [chunks(c)])[0]


def test_a_streamed_json_schema_response_validates(client):
    chunks = stream(client, messages=ask("Zoe"), response_format=PERSON_FORMAT)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_streamed_required_and_named_tool_calls_come_as_tool_call_deltas(client):
    chunks = stream(client, messages=weather("Lagos"), tools=[WEATHER], tool_choice="required")
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    jsonschema.validate(json.loads(args), WEATHER_ARGS)
    chunks = stream(client, messages=weather("Oslo"), tools=[WEATHER],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)),
                        WEATHER_ARGS)


def test_guided_choice_and_regex_on_completions(client):
    choice, regex = client.run(lambda c: [
        c.completions.create(model="default", prompt="Is the sky blue? Answer:", max_tokens=8,
                             extra_body={"guided_choice": ["yes", "no"]}),
        c.completions.create(model="default", prompt="A phone number:", max_tokens=16,
                             extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})])
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)


def test_an_invalid_schema_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.run(lambda c: [c.chat.completions.create(model="default", messages=ask("X"),
                                                        response_format=bad)])
    assert e.value.body["param"] == "response_format.json_schema.schema"
