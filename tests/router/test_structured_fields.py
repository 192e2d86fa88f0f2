"""The request fields that constrain the output become the engine's GrammarSpec; a bad
schema, regex or choice list, or two constraints at once, is a 400 naming the field."""
from __future__ import annotations

import json

import pytest

from pd_cluster.structured import GrammarKind
from router.errors import APIError
from router.protocol import ChatCompletionRequest, CompletionRequest, parse

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
DEEP: dict = {"type": "object"}
for _ in range(900):      # deeper than json.dumps can serialize
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def grammar(model=CompletionRequest, **body):
    base = {"prompt": "Hi"} if model is CompletionRequest else \
        {"messages": [{"role": "user", "content": "Hi"}]}
    return parse(model, {**base, **body}).sampling_params(8, None, 0).grammar


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_each_field_gives_its_grammar(model):
    spec = grammar(model, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}})
    assert spec.kind is GrammarKind.JSON_SCHEMA and json.loads(spec.source) == SCHEMA
    assert grammar(model, response_format={"type": "json_object"}).kind is \
        GrammarKind.JSON_OBJECT
    assert grammar(model, response_format={"type": "text"}) is None
    assert json.loads(grammar(model, guided_json=json.dumps(SCHEMA)).source) == SCHEMA
    assert grammar(model, guided_regex="[0-9]+").source == "[0-9]+"
    assert json.loads(grammar(model, guided_choice=["a", "b"]).source) == ["a", "b"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
    ({"guided_json": DEEP}, "guided_json"),
])
def test_bad_constraints_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        grammar(**body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
