"""The chart's `planner:` values (the elastic P:D planner, AppConfig.planner), rendered by a real
helm v3: the args they become, the KubeRay autoscaling they turn on, the checks that fail
`helm template` as AppConfig would fail the deployment, and the dashboard's planner panels.
The chart-wide checks (CRD schema, kubernetes-validate, lint) run on helm/ci/planner-values.yaml
too, in test_helm_chart.py.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from tests.support.helm import CHART, only, run_helm, template, validate_rayservice

from pd_cluster.planner import Action
from router.app_config import AppConfig

PLANNER_VALUES = CHART / "ci" / "planner-values.yaml"
DASHBOARD = CHART / "dashboards" / "pd-cluster.json"
# Ray Serve's schema module warns about its own pydantic usage on import.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


render = template      # `helm template` of the chart, kind -> objects


def sets(*assignments: str) -> list[str]:
    return [arg for one in assignments for arg in ("--set", one)]


def app_args(rendered: dict[str, list[dict]]) -> dict:
    serve_config = yaml.safe_load(only(rendered, "RayService")["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app["args"]


def worker_groups(rendered: dict[str, list[dict]]) -> dict[str, dict]:
    cluster = only(rendered, "RayService")["spec"]["rayClusterConfig"]
    return {g["groupName"]: g for g in cluster["workerGroupSpecs"]}


def pods(replicas: int, per_pod: int) -> int:
    return math.ceil(replicas / per_pod)


# -- args ------------------------------------------------------------------------------------

def test_planner_values_file_becomes_the_args_planner_that_app_config_accepts(helm):
    values = yaml.safe_load(PLANNER_VALUES.read_text())["planner"]
    rendered = render(helm, "-f", str(PLANNER_VALUES))
    args = app_args(rendered)
    assert args["planner"]["enabled"] is True
    for key, value in values.items():
        snake = re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), key)
        assert args["planner"][snake] == value, key
    config = AppConfig.from_args(args)
    assert (config.num_prefill, config.num_decode) == (2, 2)
    assert config.planner_gpu_budget() == 4 and config.most_engine_replicas() == 4
    assert (config.most_replicas("prefill"), config.most_replicas("decode")) == (3, 3)
    settings = config.planner_settings()
    assert (settings.ttft_s, settings.tpot_s, settings.gpu_budget) == (0.5, 0.04, 4)
    validate_rayservice(only(rendered, "RayService"))


def test_planner_off_renders_it_disabled_and_the_groups_fixed(helm):
    rendered = render(helm)
    args = app_args(rendered)
    assert args["planner"]["enabled"] is False
    config = AppConfig.from_args(args)
    assert not config.planner.enabled and config.most_engine_replicas() == 2
    cluster = only(rendered, "RayService")["spec"]["rayClusterConfig"]
    assert "enableInTreeAutoscaling" not in cluster
    for group in worker_groups(rendered).values():
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1


# -- KubeRay autoscaling ---------------------------------------------------------------------

@pytest.mark.parametrize("assignments", [
    (),                                                      # budget: the starting GPUs
    ("planner.gpuBudget=8",),
    ("planner.gpuBudget=8", "planner.maxPrefill=3", "prefill.replicasPerPod=2",
     "decode.replicasPerPod=4"),
    ("prefill.replicas=2", "decode.replicas=3", "planner.minPrefill=2", "planner.gpuBudget=12",
     "engine.tensorParallelSize=2", "prefill.gpusPerReplica=2", "decode.gpusPerReplica=2"),
    ("mode=pooled", "planner.gpuBudget=5", "planner.minDecode=1", "planner.maxDecode=2"),
], ids=["default-budget", "budget-8", "packed-pods", "tp2", "pooled"])
def test_planner_turns_on_in_tree_autoscaling_and_each_group_spans_the_planners_reach(
        helm, assignments):
    rendered = render(helm, *sets("planner.enabled=true", *assignments))
    config = AppConfig.from_args(app_args(rendered))
    rayservice = only(rendered, "RayService")
    validate_rayservice(rayservice)
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    groups = worker_groups(rendered)
    assert set(groups) == {"prefill", "decode"}
    for role, group in groups.items():
        per_pod = json.loads(yaml.safe_load(group["rayStartParams"]["resources"]))[role]
        least = getattr(config.planner, f"min_{role}")
        assert group["replicas"] == pods(getattr(config, f"num_{role}"), per_pod)
        assert group["minReplicas"] == pods(least, per_pod)
        assert group["maxReplicas"] == pods(config.most_replicas(role), per_pod)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_every_group_can_hold_the_whole_budget_the_planner_may_give_its_role(helm):
    """Budget 8, one GPU per replica: prefill may reach 7 (decode at its minimum 1), decode
    capped by maxDecode 5; two replicas per pod."""
    rendered = render(helm, *sets("planner.enabled=true", "planner.gpuBudget=8",
                                  "planner.maxDecode=5", "prefill.replicasPerPod=2",
                                  "decode.replicasPerPod=2"))
    groups = worker_groups(rendered)
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (1, 4)
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 3)
    config = AppConfig.from_args(app_args(rendered))
    assert (config.most_replicas("prefill"), config.most_replicas("decode")) == (7, 5)


# -- what the chart refuses ------------------------------------------------------------------

@pytest.mark.parametrize("assignments, message", [
    (["planner.percentile=0"], "planner.percentile: Must be greater than 0"),
    (["planner.percentile=101"], "planner.percentile: Must be less than or equal to 100"),
    (["planner.ttftMs=0"], "planner.ttftMs: Must be greater than 0"),
    (["planner.headroom=1"], "planner.headroom: Must be less than 1"),
    (["planner.minPrefill=0"], "planner.minPrefill: Must be greater than or equal to 1"),
    (["planner.gpuBudget=0"], "planner.gpuBudget: Must be greater than or equal to 1"),
    (["planner.calmIntervals=1.5"], "planner.calmIntervals: Invalid type. Expected: integer"),
    (["planner.cooldownS=-1"], "planner.cooldownS: Must be greater than or equal to 0"),
    (["planner.enabled=yes"], "planner.enabled: Invalid type. Expected: boolean"),
    (["planner.interval=30"], "planner: Additional property interval is not allowed"),
])
def test_invalid_planner_values_fail_helm_template_with_the_schema_message(
        helm, assignments, message):
    done = run_helm(helm, "template", "pd", str(CHART), *sets(*assignments))
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_a_string_budget_fails_the_schema(helm):
    done = run_helm(helm, "template", "pd", str(CHART), "--set-string", "planner.gpuBudget=4")
    assert done.returncode != 0
    assert "planner.gpuBudget: Invalid type. Expected: [integer,null], given: string" \
        in done.stderr, done.stderr


@pytest.mark.parametrize("assignments, message, args, app_message", [
    (["mode=colocated"], "planner.enabled needs mode disaggregated or pooled",
     {"mode": "colocated"}, "planner: needs disaggregated or pooled mode"),
    (["prefill.tensorParallelSize=2", "prefill.gpusPerReplica=2"],
     "planner.enabled needs one tensor-parallel size for both roles (a flip keeps the "
     "engine's weights, sharded one way): prefill.tensorParallelSize is 2, "
     "engine.tensorParallelSize 1",
     {"prefill_tensor_parallel_size": 2}, "planner: needs one tensor-parallel size"),
    (["planner.minPrefill=3", "planner.maxPrefill=2"],
     "planner.maxPrefill (2) is below planner.minPrefill (3)",
     {"planner": {"min_prefill": 3, "max_prefill": 2}},
     "planner.max_prefill: 2 is below planner.min_prefill 3"),
    (["decode.replicas=4", "planner.maxDecode=3"],
     "decode.replicas (4) is outside planner.minDecode..maxDecode (1..3)",
     {"num_decode": 4, "planner": {"max_decode": 3}},
     r"num_decode: 4 is outside planner.min_decode..max_decode \(1..3\)"),
    (["prefill.replicas=2", "decode.replicas=2", "planner.gpuBudget=3"],
     "planner.gpuBudget (3) is below the 4 GPUs the tiers start with",
     {"num_prefill": 2, "num_decode": 2, "planner": {"gpu_budget": 3}},
     "planner.gpu_budget: 3 is below the 4 GPUs the tiers start with"),
])
def test_inconsistent_planner_values_fail_helm_template_as_app_config_would(
        helm, assignments, message, args, app_message):
    """JSON schema cannot compare values: the chart checks the planner's rules itself, so that
    `helm install` fails instead of the deployment; AppConfig owns the same rules."""
    done = run_helm(helm, "template", "pd", str(CHART),
                    *sets("planner.enabled=true", *assignments))
    assert done.returncode != 0 and message in done.stderr, done.stderr
    planner = {"enabled": True, **args.pop("planner", {})}
    with pytest.raises(ValueError, match="^" + app_message):
        AppConfig.from_args({**args, "planner": planner})


def test_the_planners_rules_do_not_apply_while_it_is_off(helm):
    rendered = render(helm, *sets("mode=colocated", "planner.maxDecode=1", "decode.replicas=3"))
    config = AppConfig.from_args(app_args(rendered))
    assert config.num_decode == 3 and not config.planner.enabled


# -- Grafana ---------------------------------------------------------------------------------

def exported_names(*metrics) -> set[str]:
    """Sample names prometheus_client exports for these metrics (a Counter's get _total)."""
    registry = CollectorRegistry()
    for make in metrics:
        make(registry)
    text = generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def selected_names(expr: str) -> list[str]:
    """The `__name__=~"..."` patterns of a PromQL expression, as Python regexes."""
    return re.findall(r'__name__=~"([^"]+)"', expr)


def planner_panels() -> dict[str, dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {p["title"]: p for p in dashboard["panels"] if p["title"].startswith("P:D planner")}


def test_dashboard_shows_the_planners_decisions_by_action():
    panel = planner_panels()["P:D planner decisions"]
    (target,) = panel["targets"]
    assert "by (action)" in target["expr"] and target["legendFormat"] == "{{action}}"

    def counter(registry):
        c = Counter("pd_planner_decisions", "Planner decisions.", ("action",), registry=registry)
        for action in Action:
            c.labels(action.value).inc()

    names = exported_names(counter)
    (pattern,) = selected_names(target["expr"])
    matched = {n for n in names | {f"ray_{n}" for n in names} if re.fullmatch(pattern, n)}
    assert matched == {"pd_planner_decisions_total", "ray_pd_planner_decisions_total"}


def test_dashboard_shows_target_and_ready_tier_sizes_by_role():
    panel = planner_panels()["P:D planner tier sizes"]
    exprs = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    assert set(exprs) == {"target {{role}}", "ready {{role}}"}
    assert 'state="ready"' in exprs["ready {{role}}"]
    assert all("by (role)" in e for e in exprs.values())

    def gauges(registry):
        Gauge("pd_tier_target_replicas", "Target.", ("role",), registry=registry)\
            .labels("prefill").set(1)
        Gauge("pd_tier_replicas", "By state.", ("role", "state"), registry=registry)\
            .labels("prefill", "ready").set(1)

    names = exported_names(gauges)
    for legend, wanted in [("target {{role}}", "pd_tier_target_replicas"),
                           ("ready {{role}}", "pd_tier_replicas")]:
        (pattern,) = selected_names(exprs[legend])
        assert {n for n in names if re.fullmatch(pattern, n)} == {wanted}


def test_planner_values_render_the_planner_panels_into_the_dashboard_config_map(helm):
    rendered = render(helm, "-f", str(PLANNER_VALUES))
    (dashboard,) = [json.loads(v) for v in only(rendered, "ConfigMap", "-dashboard")["data"]
                    .values()]
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"P:D planner decisions", "P:D planner tier sizes"} <= titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
