"""The chart values of the config tree: AppConfig's JSON schema (pydantic's), written the way
helm reads and reports it.

Each tree field is the value of the same path in camelCase (`engine.max_num_seqs` ->
`engine.maxNumSeqs`; the chart's `pd-cluster.snakeKeys` turns them back), except the fields
in MOVED, which the chart groups elsewhere, and those in COMPUTED, which it derives itself.
"""
from __future__ import annotations

from typing import Any

from router.app_config import AppConfig

Schema = dict[str, Any]
# Tree fields whose value sits at another path of the chart: the router deployment's under
# `router:`, and a worker group's replicas and tensor-parallel size with its other sizes.
MOVED: dict[str, tuple[str, ...]] = {
    "num_prefill": ("prefill", "replicas"),
    "num_decode": ("decode", "replicas"),
    "prefill_tensor_parallel_size": ("prefill", "tensorParallelSize"),
    "decode_tensor_parallel_size": ("decode", "tensorParallelSize"),
    "router_replicas": ("router", "replicas"),
    "router_autoscaling": ("router", "autoscaling"),
}
# Tree fields the chart computes from values of its own, with where from.
COMPUTED: dict[str, str] = {
    "prefill_resources": "prefill.gpusPerReplica / cpusPerReplica and the group's resource",
    "decode_resources": "decode.gpusPerReplica / cpusPerReplica and the group's resource",
    "api_key_env": "apiKey.envName, when apiKey.secretName is set",
}
# pydantic's keywords that say nothing to helm: values.yaml holds the defaults, and the chart
# requires what its templates read (chart.py), not what the tree has no default for.
_DROPPED = ("title", "default", "required")
_NULL = {"type": "null"}


def camel(name: str) -> str:
    """A tree field's name as a chart value's: max_num_seqs -> maxNumSeqs."""
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def value_path(field: str) -> tuple[str, ...]:
    """The chart path of the top-level tree field `field` (not one of COMPUTED)."""
    return MOVED.get(field, (camel(field),))


def tree_properties() -> Schema:
    """The top-level `properties` of the chart's values that the tree declares: the tree's
    sections and fields in camelCase, MOVED ones nested at their paths."""
    schema = AppConfig.model_json_schema()
    properties: Schema = {}
    for field, node in schema["properties"].items():
        if field in COMPUTED:
            continue
        *parents, name = value_path(field)
        into = properties
        for parent in parents:
            into = into.setdefault(parent, {}).setdefault("properties", {})
        into[name] = _value_schema(node, schema["$defs"])
    return properties


def _value_schema(node: Schema, defs: dict[str, Schema]) -> Schema:
    """One node of pydantic's schema as helm's: nested models (and lists' items) inlined (a
    field's description over its model's docstring), `X | None` as `type: [x, "null"]` (or
    null among the enum), a single choice as an enum, an enum without its redundant `type`,
    property names in camelCase. helm's messages name the value and the rule ("Invalid type. Expected:
    [integer,null]"), which an anyOf would bury."""
    node = {key: value for key, value in node.items() if key not in _DROPPED}
    if "$ref" in node:
        node = {**defs[node.pop("$ref").rsplit("/", 1)[-1]], **node}
        return _value_schema(node, defs)
    if "anyOf" in node:
        members = node.pop("anyOf")
        inner = [m for m in members if m != _NULL]
        if len(inner) != 1 or len(members) != 2:
            raise ValueError(f"{members}: only `X | None` unions become chart values")
        return _nullable({**_value_schema(inner[0], defs), **node})
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node:
        node.pop("type", None)
    if "properties" in node:
        node["properties"] = {camel(name): _value_schema(prop, defs)
                              for name, prop in node["properties"].items()}
    if "items" in node:         # a list of models (tenants): each item inlined alike
        node["items"] = _value_schema(node["items"], defs)
    return node


def _nullable(node: Schema) -> Schema:
    if "enum" in node:
        return {**node, "enum": [*node["enum"], None]}
    return {**node, "type": [node["type"], "null"]}
