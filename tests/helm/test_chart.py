"""The Helm chart, rendered by a real helm v3 and checked the way a cluster would check it.

Core objects go through `kubernetes-validate --strict`; the RayService through the KubeRay CRD
schema carried in `tests/data/kuberay-crds/` with unknown fields rejected; its serveConfigV2
through Ray Serve's schema and the project's own AppConfig.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from tests.support import REPO

from router.app_config import AUTO, ROLE_RESOURCE_SHARE, AppConfig
from tests.support.helm import CHART, only, run_helm, template, validate_rayservice

VALUE_FILES = {"default": None, **{p.name.removesuffix("-values.yaml"): p
                                   for p in sorted((CHART / "ci").glob("*-values.yaml"))}}
KUBE_VERSIONS = ("1.25", "1.37")      # the chart's kubeVersion floor, and the newest known
# Ray Serve's schema module warns about its own pydantic usage on import.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def helm_args(values: Path | None) -> list[str]:
    return ["-f", str(values)] if values else []


@pytest.fixture(scope="module", params=sorted(VALUE_FILES))
def rendered(request, helm) -> dict[str, list[dict]]:
    """The chart rendered with one values file: kind -> objects."""
    return template(helm, "--namespace", "llm", *helm_args(VALUE_FILES[request.param]))


def serve_app(rendered) -> dict:
    serve_config = yaml.safe_load(only(rendered, "RayService")["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    return app


@pytest.mark.parametrize("name", sorted(VALUE_FILES))
def test_helm_lint_strict_passes(helm, name):
    done = run_helm(helm, "lint", "--strict", str(CHART), *helm_args(VALUE_FILES[name]))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_core_objects_pass_kubernetes_validate_strict(rendered, tmp_path):
    core = [o for kind, objs in rendered.items() if kind not in ("RayService", "ServiceMonitor")
            for o in objs]
    # RayService metadata is only `type: object` in the CRD: check it as a core object's.
    core += [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": o["metadata"]}
             for o in rendered["RayService"] + rendered.get("ServiceMonitor", [])]
    # Pod templates inside the RayService, as the Pods KubeRay will create from them.
    core += [{"apiVersion": "v1", "kind": "Pod", **template}
             for template in pod_templates(only(rendered, "RayService")).values()]
    files = []
    for i, obj in enumerate(core):
        files.append(tmp_path / f"{i}-{obj['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(obj))
    for version in KUBE_VERSIONS:
        done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version,
                               *map(str, files)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "ERROR" not in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_rayservice_matches_kuberay_crd_with_unknown_fields_rejected(rendered):
    rayservice = only(rendered, "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    validate_rayservice(rayservice)


def test_crd_check_rejects_an_unknown_field_deep_in_the_pod_template(rendered):
    rayservice = copy.deepcopy(only(rendered, "RayService"))
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    head["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="gpus"):
        validate_rayservice(rayservice)


def test_serve_config_is_accepted_by_ray_serve_and_app_config(rendered):
    from ray.serve.schema import ServeDeploySchema

    serve_config = yaml.safe_load(only(rendered, "RayService")["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    app = serve_app(rendered)
    assert app["import_path"] == "router.app:build_app" and app["route_prefix"] == "/"
    AppConfig.from_args(app["args"])


def test_pd_yaml_is_a_ray_serve_config_with_the_same_application():
    from ray.serve.schema import ServeDeploySchema

    serve_config = yaml.safe_load((REPO / "configs" / "pd.yaml").read_text())
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "router.app:build_app"
    AppConfig.from_args(app["args"])


def pod_templates(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    return {"head": cluster["headGroupSpec"]["template"], **groups}


def test_each_engine_tier_is_a_worker_group_sized_and_pinned_for_its_replicas(rendered):
    config = AppConfig.from_args(serve_app(rendered)["args"])
    cluster = only(rendered, "RayService")["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    wanted = {"prefill": config.num_prefill, "decode": config.num_decode}
    assert set(groups) == {role for role, n in wanted.items() if n}
    for role, group in groups.items():
        resources = getattr(config, f"{role}_resources")
        assert resources.resources == {role: ROLE_RESOURCE_SHARE}
        advertised = yaml.safe_load(yaml.safe_load(group["rayStartParams"]["resources"]))
        container = group["template"]["spec"]["containers"][0]
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        per_pod = advertised[role]
        assert group["replicas"] * per_pod >= wanted[role] > (group["replicas"] - 1) * per_pod
        assert gpus == resources.num_gpus * per_pod
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts


def test_router_service_selects_serving_ray_pods_by_a_named_port(rendered):
    service = only(rendered, "Service", "-router")
    (port,) = service["spec"]["ports"]
    for template in pod_templates(only(rendered, "RayService")).values():
        labels = template["metadata"]["labels"]
        assert {k: v for k, v in service["spec"]["selector"].items() if k != "ray.io/serve"} \
            .items() <= labels.items()
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert port["targetPort"] in ports
    assert service["spec"]["selector"]["ray.io/serve"] == "true"


def haproxy_env(rayservice: dict) -> set[str | None]:
    """RAY_SERVE_ENABLE_HA_PROXY of each Ray container."""
    return {next((e.get("value") for e in t["spec"]["containers"][0]["env"]
                  if e["name"] == "RAY_SERVE_ENABLE_HA_PROXY"), None)
            for t in pod_templates(rayservice).values()}


def test_every_ray_pod_starts_with_haproxy_ingress_on_the_service_port(rendered):
    rayservice = only(rendered, "RayService")
    assert haproxy_env(rayservice) == {"1"}
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (port,) = only(rendered, "Service", "-router")["spec"]["ports"]
    assert port["port"] == serve_config["http_options"]["port"] == 8000


def test_haproxy_ingress_can_be_turned_off(helm):
    done = run_helm(helm, "template", "pd", str(CHART), "--set", "service.haproxy=false")
    assert done.returncode == 0, done.stderr
    (rayservice,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "RayService"]
    assert haproxy_env(rayservice) == {"0"}


def test_service_monitors_find_the_ray_and_router_metrics_services(rendered):
    if "ServiceMonitor" not in rendered:
        pytest.skip("metrics.serviceMonitor disabled in these values")
    monitors = rendered["ServiceMonitor"]
    assert len(monitors) == 2  # Ray's per-pod metrics, and the router's pd_* metrics
    scraped = set()
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        matched = [s for s in rendered["Service"]
                   if monitor["spec"]["selector"]["matchLabels"].items()
                   <= s["metadata"]["labels"].items()]
        (service,) = matched
        port_names = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
        scraped.add(service["metadata"]["name"])
    assert any(name.endswith("-router") for name in scraped)


def test_dashboard_config_map_holds_a_grafana_dashboard(rendered):
    if "ConfigMap" not in rendered:
        pytest.skip("metrics.dashboard disabled in these values")
    (dashboard,) = [json.loads(v) for v in only(rendered, "ConfigMap", "-dashboard")["data"]
                    .values()]
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])


def test_pods_run_non_root_read_only_with_only_rdma_capabilities(rendered):
    rdma = any("rdma" in str(c["resources"]) for t in pod_templates(only(rendered, "RayService"))
               .values() for c in t["spec"]["containers"])
    for role, template in pod_templates(only(rendered, "RayService")).items():
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        (container,) = template["spec"]["containers"]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
        assert context["capabilities"]["drop"] == ["ALL"]
        added = context["capabilities"].get("add", [])
        assert added == (["IPC_LOCK"] if rdma and role != "head" else [])


@pytest.mark.parametrize("sets, message", [
    (["prefill.replicas=-1"], "prefill.replicas: Must be greater than or equal to"),
    (["decode.replicas=-2"], "decode.replicas: Must be greater than or equal to 1"),
    (["prefill.replicas=0"], "prefill.replicas: Must be greater than or equal to 1"),
    (["engine.model=null"], "engine: model is required"),
    (["engine.model="], "engine.model: String length must be greater than or equal to 1"),
    (["engine.attentionBackend=flash"], "engine.attentionBackend must be one of the following"),
    (["conditionalDisaggThreshold=-1"], "conditionalDisaggThreshold: Must be greater than"),
    (["transport=tcp"], 'transport must be one of the following: "nixl", "ucx", "ray", "local"'),
    (["mode=split"], "mode must be one of the following"),
    (["engine.blockSize=12"], "engine.blockSize must be one of the following"),
    (["prefil.replicas=2"], "Additional property prefil is not allowed"),
    (["engine.maxModelLen=1024"], "limits.maxTokens (4096) exceeds engine.maxModelLen (1024)"),
    (["engine.gpuMemoryUtilization=1.5"], "engine.gpuMemoryUtilization"),
    (["router.replicas=0"], "router.replicas: Must be greater than or equal to 1"),
    (["router.replicas=1.5"], "router.replicas: Invalid type. Expected: integer"),
    (["router.autoscaling.minReplicas=0"], "router.autoscaling.minReplicas: Must be greater"),
    (["router.autoscaling.maxReplicas=0"], "router.autoscaling.maxReplicas: Must be greater"),
    (["router.autoscaling.targetOngoingRequests=0"],
     "router.autoscaling.targetOngoingRequests: Must be greater than 0"),
    (["router.autoscaling.upscaleDelayS=-1"], "router.autoscaling.upscaleDelayS: Must be greater"),
    (["router.autoscaling.enabled=yes"], "router.autoscaling.enabled: Invalid type"),
    (["router.autoscaling.metricsIntervalS=5"],
     "router.autoscaling: Additional property metricsIntervalS is not allowed"),
])
def test_invalid_values_fail_helm_template_with_the_schema_message(helm, sets, message):
    set_args = [arg for s in sets for arg in ("--set", s)]
    done = run_helm(helm, "template", "pd", str(CHART), *set_args)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


def test_default_chart_serves_what_pd_yaml_serves_with_resources_written_out(helm):
    done = run_helm(helm, "template", "pd", str(CHART))
    (rayservice,) = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "RayService"]
    (chart_app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    (pd_app,) = yaml.safe_load((REPO / "configs" / "pd.yaml").read_text())["applications"]
    from_chart, from_pd_yaml = (AppConfig.from_args(a["args"]) for a in (chart_app, pd_app))
    assert from_pd_yaml.prefill_resources == from_pd_yaml.decode_resources == AUTO
    auto = {"prefill_resources": AUTO, "decode_resources": AUTO}
    assert from_chart.model_copy(update=auto) == from_pd_yaml
