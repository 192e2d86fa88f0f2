"""The Helm chart's engine and router values, rendered by a real helm v3: router replicas or
Serve autoscaling, the NOTES, and tensor-parallel sizes per tier, each checked against what
AppConfig makes of the same args."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from router.app_config import AppConfig
from tests.support.helm import CHART, run_helm

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# -- the router deployment: replicas or Serve autoscaling ------------------------------------

def rendered_app_args(helm: Path, *sets: str) -> dict:
    set_args = [arg for one in sets for arg in ("--set", one)]
    done = run_helm(helm, "template", "pd", str(CHART), *set_args)
    assert done.returncode == 0, done.stderr
    (rayservice,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "RayService"]
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    return app["args"]


def test_default_chart_runs_one_router_replica_without_autoscaling(helm):
    args = rendered_app_args(helm)
    assert args["router_replicas"] == 1 and args["router_autoscaling"] is None
    assert AppConfig.from_args(args).router_deployment_options() == {"num_replicas": 1}


def test_router_replicas_value_sets_the_router_deployments_replicas(helm):
    args = rendered_app_args(helm, "router.replicas=3")
    assert args["router_replicas"] == 3 and args["router_autoscaling"] is None
    assert AppConfig.from_args(args).router_deployment_options() == {"num_replicas": 3}


def test_router_autoscaling_values_become_serves_autoscaling_config(helm):
    from ray.serve.config import AutoscalingConfig

    args = rendered_app_args(helm, "router.autoscaling.enabled=true",
                             "router.autoscaling.minReplicas=2",
                             "router.autoscaling.maxReplicas=8",
                             "router.autoscaling.targetOngoingRequests=32")
    assert "router_replicas" not in args       # one way to size the router in the args
    assert args["router_autoscaling"] == {
        "min_replicas": 2, "max_replicas": 8, "initial_replicas": None,
        "target_ongoing_requests": 32, "upscale_delay_s": 30, "downscale_delay_s": 600}
    options = AppConfig.from_args(args).router_deployment_options()
    assert set(options) == {"autoscaling_config"}
    scaling = AutoscalingConfig(**options["autoscaling_config"])
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == \
        (2, 8, 32.0)


@pytest.mark.parametrize("sets, message, args, app_message", [
    (["router.autoscaling.minReplicas=5"],
     "router.autoscaling.maxReplicas (4) is below minReplicas (5)",
     {"min_replicas": 5, "max_replicas": 4}, "router_autoscaling.max_replicas:"),
    (["router.autoscaling.initialReplicas=9"],
     "router.autoscaling.initialReplicas (9) is outside minReplicas..maxReplicas (1..4)",
     {"max_replicas": 4, "initial_replicas": 9}, "router_autoscaling.initial_replicas:"),
    (["router.replicas=2"], "router.replicas (2) with router.autoscaling.enabled",
     {"max_replicas": 4, "router_replicas": 2}, "router_replicas: 2 with router_autoscaling"),
])
def test_inconsistent_router_autoscaling_fails_helm_template_as_app_config_would(
        helm, sets, message, args, app_message):
    """JSON schema cannot compare two values: the chart checks min <= initial <= max itself,
    so that `helm install` fails instead of the deployment; AppConfig owns the same rules."""
    set_args = [a for one in ["router.autoscaling.enabled=true", *sets] for a in ("--set", one)]
    done = run_helm(helm, "template", "pd", str(CHART), *set_args)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    replicas = {k: args.pop(k) for k in list(args) if k == "router_replicas"}
    with pytest.raises(ValueError, match="^" + app_message):
        AppConfig.from_args({"router_autoscaling": args, **replicas})


def test_notes_name_the_model_and_size_the_head_for_the_router_replicas(helm, tmp_path):
    """`helm template` does not render NOTES.txt: render it through `tpl` in a copy."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.tpl")
    (chart / "templates" / "notes.yaml").write_text(
        'notes: {{ tpl (.Files.Get "notes.tpl") . | toJson }}\n')

    def notes(*sets: str) -> str:
        set_args = [a for one in sets for a in ("--set", one)]
        done = run_helm(helm, "template", "pd", str(chart), "--show-only",
                        "templates/notes.yaml", *set_args)
        assert done.returncode == 0, done.stderr
        return yaml.safe_load(done.stdout)["notes"]

    default = notes()
    assert 'serving of "default"' in default and '"model": "default"' in default
    assert "Router: 1 replica(s)." in default and "Ray CPU" not in default
    scaled = notes("router.autoscaling.enabled=true", "router.autoscaling.maxReplicas=6")
    assert "between 1 and 6 replicas" in scaled
    assert "head has cpu 4 (head.resources): give it one per router replica (6)" in scaled


def test_tensor_parallel_size_reaches_the_engine_and_needs_a_gpu_per_rank(helm):
    args = rendered_app_args(helm, "mode=colocated", "engine.tensorParallelSize=2",
                             "decode.gpusPerReplica=2")
    assert args["engine"]["tensor_parallel_size"] == 2
    assert args["decode_resources"]["num_gpus"] == 2
    done = run_helm(helm, "template", "pd", str(CHART), "--set", "mode=colocated",
                    "--set", "engine.tensorParallelSize=2")
    message = "decode.gpusPerReplica (1) is below engine.tensorParallelSize (2)"
    assert done.returncode != 0 and message in done.stderr, done.stderr
    with pytest.raises(ValueError, match="^decode_resources.num_gpus: 1 for "
                                         "engine.tensor_parallel_size 2"):
        AppConfig.from_args({"mode": "colocated", "engine": {"tensor_parallel_size": 2},
                             "decode_resources": {"num_gpus": 1}})


def test_each_tier_may_run_its_own_tensor_parallel_size(helm):
    args = rendered_app_args(helm, "prefill.tensorParallelSize=2", "prefill.gpusPerReplica=2")
    assert args["prefill_tensor_parallel_size"] == 2
    assert args["decode_tensor_parallel_size"] is None
    config = AppConfig.from_args(args)
    assert (config.tensor_parallel_size("prefill"), config.tensor_parallel_size("decode")) == (2, 1)
    done = run_helm(helm, "template", "pd", str(CHART), "--set", "decode.tensorParallelSize=4",
                    "--set", "decode.gpusPerReplica=2")
    message = "decode.gpusPerReplica (2) is below decode.tensorParallelSize (4)"
    assert done.returncode != 0 and message in done.stderr, done.stderr


# -- tenants ----------------------------------------------------------------------------------

def test_tenants_reach_the_app_in_its_own_names_and_exclude_the_single_key(helm):
    args = rendered_app_args(helm, "tenants[0].name=team-a", "tenants[0].apiKeyEnv=TEAM_A_KEY",
                             "tenants[0].requestsPerS=5", "tenants[0].tokensPerS=20000")
    assert args["tenants"] == [{"name": "team-a", "api_key_env": "TEAM_A_KEY",
                                "requests_per_s": 5, "tokens_per_s": 20000}]
    assert AppConfig.from_args(args).tenants[0].requests_per_s == 5
    both = run_helm(helm, "template", "pd", str(CHART), "--set", "apiKey.secretName=s",
                    "--set", "tenants[0].name=a", "--set", "tenants[0].apiKeyEnv=A")
    assert both.returncode != 0 and "apiKey.secretName or tenants, not both" in both.stderr
