"""The three surfaces of the app's configuration agree with its one tree (router/app_config.py
AppConfig, its `engine:` pd_cluster/config.py EngineConfig):

- configs/pd.yaml's args validate and name every field of the tree;
- helm/values.schema.json describes exactly the tree's fields that the chart exposes (values
  are the tree's paths in camelCase), with the tree's choices, bounds and nullability;
- the chart, rendered by a real helm, passes every exposed value through as the arg of the
  same path, and its default values are the tree's defaults.

A field added to the tree and not to pd.yaml, the schema and values.yaml fails here.
"""
from __future__ import annotations

import json
import subprocess
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
import pytest
import yaml
from helm_binary import helm_binary
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from router.app_config import AppConfig

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm"
FieldPath = tuple[str, ...]
# Tree fields the chart computes itself instead of taking a value of the same path.
CHART_COMPUTED: dict[FieldPath, str] = {
    ("num_prefill",): "prefill.replicas (none in colocated mode)",
    ("num_decode",): "decode.replicas",
    ("prefill_resources",): "prefill.gpusPerReplica / cpusPerReplica and the group's resource",
    ("decode_resources",): "decode.gpusPerReplica / cpusPerReplica and the group's resource",
    ("api_key_env",): "apiKey.envName, when apiKey.secretName is set",
}
# Top-level values that are the chart's own (Kubernetes objects, images, pods), no tree field.
CHART_ONLY = {"global", "nameOverride", "fullnameOverride", "image", "imagePullSecrets",
              "rayVersion", "apiKey", "extraEnv", "head", "prefill", "decode", "rdma", "ucx",
              "podSecurityContext", "containerSecurityContext", "service", "metrics"}
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
BOUNDS = {"minimum": (annotated_types.Ge, "ge"), "exclusiveMinimum": (annotated_types.Gt, "gt"),
          "maximum": (annotated_types.Le, "le"), "exclusiveMaximum": (annotated_types.Lt, "lt")}


def submodel(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
        else None


def leaves(model: type[BaseModel] = AppConfig,
           prefix: FieldPath = ()) -> dict[FieldPath, FieldInfo]:
    """Every field of the tree that holds a value, by its path (nested models recursed)."""
    found: dict[FieldPath, FieldInfo] = {}
    for name, field in model.model_fields.items():
        inner = submodel(field)
        found.update(leaves(inner, prefix + (name,)) if inner else {prefix + (name,): field})
    return found


EXPOSED = {path: field for path, field in leaves().items() if path not in CHART_COMPUTED}


def camel(path: FieldPath) -> FieldPath:
    def one(name: str) -> str:
        head, *rest = name.split("_")
        return head + "".join(word.capitalize() for word in rest)
    return tuple(map(one, path))


def named_paths(args: dict, model: type[BaseModel] = AppConfig, prefix: FieldPath = ()) -> set:
    """The leaf paths a mapping of args names, following the tree into nested models."""
    named = set()
    for key, value in args.items():
        inner = submodel(model.model_fields[key])
        named |= named_paths(value, inner, prefix + (key,)) if inner and isinstance(value, dict) \
            else {prefix + (key,)}
    return named


def pd_yaml_args() -> dict:
    (app,) = yaml.safe_load((REPO / "configs" / "pd.yaml").read_text())["applications"]
    return app["args"]


def test_pd_yaml_validates_and_names_every_field_of_the_tree():
    args = pd_yaml_args()
    AppConfig.from_args(args)
    missing = sorted(".".join(p) for p in set(leaves()) - named_paths(args))
    assert not missing, f"configs/pd.yaml lacks {missing}: add each, with a comment"


def test_the_tree_fields_are_described():
    undescribed = [".".join(p) for p, field in leaves().items() if not field.description]
    assert not undescribed


# -- helm/values.schema.json ---------------------------------------------------------------

def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def schema_leaves(node: dict, prefix: FieldPath = ()) -> set[FieldPath]:
    found = set()
    for name, prop in node["properties"].items():
        if not prefix and name in CHART_ONLY:
            continue
        path = prefix + (name,)
        found |= schema_leaves(prop, path) if "properties" in prop else {path}
    return found


def test_schema_describes_exactly_the_fields_the_chart_exposes():
    described, wanted = schema_leaves(schema()), {camel(p) for p in EXPOSED}
    assert not wanted - described, f"tree fields missing from the schema: {wanted - described}"
    assert not described - wanted, (f"schema properties with no tree field: "
                                    f"{described - wanted} (chart-only ones go in CHART_ONLY)")


def schema_property(path: FieldPath) -> dict:
    node = schema()
    for name in camel(path):
        node = node["properties"][name]
    return node


def base_type(annotation: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        (inner,) = args
        return inner, True
    return annotation, False


def with_value(path: FieldPath, value: Any) -> dict:
    args: dict = {}
    node = args
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node[path[-1]] = value
    return args


@pytest.mark.parametrize("path", sorted(EXPOSED), ids=".".join)
def test_schema_property_has_the_tree_fields_choices_bounds_and_nullability(path):
    prop, field = schema_property(path), EXPOSED[path]
    inner, nullable = base_type(field.annotation)
    if typing.get_origin(inner) is Literal:
        assert prop["enum"] == list(typing.get_args(inner))
        return
    types_ = prop["type"] if isinstance(prop.get("type"), list) else [prop.get("type")]
    assert ("null" in types_) == nullable
    if "enum" in prop:          # a narrower set than the tree's type (block sizes): all valid
        for value in prop["enum"]:
            AppConfig.from_args(with_value(path, value))
        return
    assert JSON_TYPES[inner] in types_
    for key, (kind, name) in BOUNDS.items():
        in_tree = [getattr(m, name) for m in field.metadata if isinstance(m, kind)]
        assert in_tree == ([prop[key]] if key in prop else []), key


# -- the chart's rendered args ---------------------------------------------------------------

def lookup(config: BaseModel, path: FieldPath) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def lookup_value(values: dict, path: FieldPath) -> Any:
    for name in path:
        values = values[name]
    return values


def rendered_args(*helm_args: str) -> dict:
    done = subprocess.run([str(helm_binary()), "template", "pd", str(CHART), *helm_args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (service,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "RayService"]
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    return app["args"]


def test_chart_default_args_are_every_exposed_field_at_the_trees_default():
    args = rendered_args()
    config, defaults = AppConfig.from_args(args), AppConfig()
    assert named_paths(args) - set(CHART_COMPUTED) == set(EXPOSED)
    for path in EXPOSED:
        assert lookup(config, path) == lookup(defaults, path), ".".join(path)


def test_every_value_reaches_the_arg_of_the_same_path(tmp_path):
    values = {"engine": {"maxNumBatchedTokens": 4096, "seed": 7, "cudaGraphs": False,
                         "numKvBlocks": 64, "asyncScheduling": True, "kvCacheMemoryGb": 2.5},
              "limits": {"maxQueue": 9, "requestTimeoutS": 1.5},
              "routing": {"prefillWeight": 0.5},
              "conditionalDisaggThreshold": 100, "prefillFailurePolicy": "fail"}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    config = AppConfig.from_args(rendered_args("-f", str(tmp_path / "values.yaml")))
    for path in EXPOSED:
        try:
            value = lookup_value(values, camel(path))
        except KeyError:
            continue
        assert lookup(config, path) == value, ".".join(path)
