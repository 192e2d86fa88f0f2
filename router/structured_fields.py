"""The request fields that constrain the output: `response_format` (OpenAI), vLLM's
`guided_json` / `guided_regex` / `guided_choice`, and on chat `tools` / `tool_choice`;
validated here into the engine's GrammarSpec, a bad schema or regex a 400 naming the field."""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_cluster.structured import GrammarSpec
from router.errors import ErrorCode, bad_request
from router.tracing import stage


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """Its arguments' JSON schema (none given: any JSON object)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def schema_grammar(schema: dict[str, Any] | bool, param: str) -> GrammarSpec:
    """The checked grammar of a JSON schema; a 400 naming `param` if it is not usable (too
    deeply nested to serialize included)."""
    try:
        spec = GrammarSpec.json_schema(schema)
    except RecursionError:
        raise bad_request(f"{param}: the schema is nested too deeply", param=param,
                          code=ErrorCode.INVALID_VALUE) from None
    return checked(spec, param)


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec` if llguidance can build it; else a 400 naming `param` with its reason."""
    began = time.monotonic()
    try:
        spec.check()    # llguidance compiles the grammar: a request trace's grammar.compile
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param, code=ErrorCode.INVALID_VALUE) from None
    finally:
        stage("grammar.compile", began, time.monotonic(), **{"pd.grammar.kind": str(spec.kind),
                                                             "pd.grammar.param": param})
    return spec


def output_grammar(response_format: ResponseFormat | None, guided_json: Any,
                   guided_regex: str | None, guided_choice: list[str] | None
                   ) -> GrammarSpec | None:
    """The grammar the request's fields ask for (at most one of them may ask)."""
    asked: list[tuple[str, GrammarSpec]] = []
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", GrammarSpec.json_object()))
    elif response_format is not None and response_format.type == "json_schema":
        fmt = response_format.json_schema
        if fmt is None:
            raise bad_request("response_format.json_schema: required when type is "
                              "'json_schema'", param="response_format.json_schema",
                              code=ErrorCode.INVALID_VALUE)
        schema = fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
        param = "response_format.json_schema.schema"
        asked.append((param, schema_grammar(schema, param)))
    if guided_json is not None:
        if isinstance(guided_json, str):      # vLLM takes the schema as JSON text too
            try:
                guided_json = json.loads(guided_json)
            except ValueError:
                guided_json = None
        if not isinstance(guided_json, (dict, bool)):
            raise bad_request("guided_json: must be a JSON schema (an object, or its JSON "
                              "text)", param="guided_json", code=ErrorCode.INVALID_VALUE)
        asked.append(("guided_json", schema_grammar(guided_json, "guided_json")))
    if guided_regex is not None:
        asked.append(("guided_regex", checked(GrammarSpec.regex(guided_regex), "guided_regex")))
    if guided_choice is not None:
        asked.append(("guided_choice", checked(GrammarSpec.choice(guided_choice),
                                               "guided_choice")))
    if len(asked) > 1:
        names = ", ".join(p.split(".")[0] for p, _ in asked)
        raise bad_request(f"{asked[1][0].split('.')[0]}: only one output constraint per "
                          f"request; got {names}", param=asked[1][0].split(".")[0],
                          code=ErrorCode.INVALID_VALUE)
    return asked[0][1] if asked else None
