"""The three surfaces of the app's configuration agree with its one tree (router/app_config.py
AppConfig, its `engine:` pd_cluster/config.py EngineConfig):

- configs/pd.yaml's args validate and name every field of the tree;
- helm/values.schema.json is what `python -m router.helm_schema` generates from the tree (values are
  the tree's paths in camelCase, some moved: router/helm_schema/tree.py);
- the chart, rendered by a real helm, passes every exposed value through as the arg of the
  same path, and its default values are the tree's defaults.

A field added to the tree and not to pd.yaml, values.yaml or the generated schema fails here.
"""
from __future__ import annotations

import json
import subprocess
import types
import typing
from typing import Any

import yaml
from tests.support import REPO
from tests.support.helm import helm_binary
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pd_cluster.config import EngineConfig
from router.app_config import AppConfig
from router.helm_schema.__main__ import main as helm_schema_main
from router.helm_schema.generate import schema_text
from router.helm_schema.tree import COMPUTED, camel
from router.helm_schema.tree import value_path as top_value_path

CHART = REPO / "helm"
FieldPath = tuple[str, ...]


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


# Tree fields the chart takes a value for (not one of those it computes), by their path.
EXPOSED = {path: field for path, field in leaves().items() if path[0] not in COMPUTED}


def value_path(path: FieldPath) -> FieldPath:
    """The chart value of a tree field: its top-level field's value path, then camelCase."""
    return top_value_path(path[0]) + tuple(map(camel, path[1:]))


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

def test_values_schema_is_the_one_generated_from_the_tree():
    committed = (CHART / "values.schema.json").read_text(encoding="utf-8")
    assert committed == schema_text(), ("helm/values.schema.json is not the generated one: run "
                                        "`python -m router.helm_schema --output "
                                        "helm/values.schema.json`")


def test_helm_schema_command_prints_or_writes_the_generated_schema(tmp_path, capsys):
    assert helm_schema_main([]) == 0
    assert capsys.readouterr().out == schema_text()
    assert helm_schema_main(["--output", str(tmp_path / "schema.json")]) == 0
    assert (tmp_path / "schema.json").read_text(encoding="utf-8") == schema_text()


def test_the_block_sizes_the_chart_allows_are_engine_block_sizes():
    """engine.blockSize's enum is the chart's (a power of two is no JSON type): the tree
    accepts each of them."""
    schema = json.loads(schema_text())
    for size in schema["properties"]["engine"]["properties"]["blockSize"]["enum"]:
        assert EngineConfig(block_size=size).block_size == size


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
    assert {p for p in named_paths(args) if p[0] not in COMPUTED} == set(EXPOSED)
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
              "kvTiers": {"enabled": True, "hostBytes": 3 * 2**30, "diskPath": "/mnt/kv",
                          "diskBytes": 2**40, "hostGbps": 12.5, "diskGbps": 2.5,
                          "prefillTokensPerS": 30000.0, "minLoadTokens": 32},
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
    assert {p for p in EXPOSED if p[0] in ("router_autoscaling", "planner", "kv_tiers")} <= reached


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
