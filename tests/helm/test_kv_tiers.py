"""The chart's kvTiers values (issue 47): they become the args' kv_tiers that AppConfig
accepts, and with the tiers on each engine pod is given the host tier's bytes (one host tier
per Ray node, i.e. per pod, in /dev/shm) in its /dev/shm size and its memory request and
limit; the head, which runs no engine, is left as it is. What AppConfig refuses of them fails
`helm template` too."""
from __future__ import annotations

import pytest
import yaml

from router.app_config import AppConfig
from tests.support.helm import CHART, only, run_helm, template, validate_rayservice

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
GIB = 2**30


def pods(rendered: dict) -> dict[str, dict]:
    """The RayService's pod specs by group: head, prefill, decode."""
    spec = only(rendered, "RayService")["spec"]["rayClusterConfig"]
    out = {"head": spec["headGroupSpec"]["template"]["spec"]}
    out.update({g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]})
    return out


def sizes(pod: dict) -> tuple[str, str, str | None]:
    """(memory request, memory limit, /dev/shm size limit) of a pod's one container."""
    (container,) = pod["containers"]
    shm = [v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm"]
    res = container["resources"]
    return res["requests"]["memory"], res["limits"]["memory"], (shm or [None])[0]


def test_kv_tiers_values_become_the_args_and_size_each_engine_pod(helm):
    rendered = template(helm, "--set", "kvTiers.enabled=true",
                        "--set", f"kvTiers.hostBytes={8 * GIB}",
                        "--set", "kvTiers.diskPath=/mnt/nvme/kv",
                        "--set", "kvTiers.minLoadTokens=64",
                        "--set", "decode.resources.requests.memory=48G",
                        "--set", "decode.shmSize=1.5Gi")
    validate_rayservice(only(rendered, "RayService"))
    (app,) = yaml.safe_load(only(rendered, "RayService")["spec"]["serveConfigV2"])["applications"]
    tiers = AppConfig.from_args(app["args"]).kv_tiers
    assert (tiers.enabled, tiers.host_bytes, tiers.disk_path, tiers.min_load_tokens) == \
        (True, 8 * GIB, "/mnt/nvme/kv", 64)
    by_group = pods(rendered)
    # 64Gi + 8Gi; 16Gi + 8Gi of /dev/shm; 48 GB (decimal) + 8 GiB rounded up to a MiB.
    assert sizes(by_group["prefill"]) == ("73728Mi", "73728Mi", "24576Mi")
    assert sizes(by_group["decode"]) == (f"{-(-(48 * 10**9 + 8 * GIB) // 2**20)}Mi", "73728Mi",
                                         "9728Mi")
    assert sizes(by_group["head"]) == ("16Gi", "16Gi", None)


def test_tiers_off_leave_the_pods_as_the_values_size_them(helm):
    by_group = pods(template(helm, "--set", f"kvTiers.hostBytes={64 * GIB}"))
    assert sizes(by_group["decode"]) == ("64Gi", "64Gi", "16Gi")


@pytest.mark.parametrize("sets, message", [
    (["kvTiers.enabled=true", "decode.resources.requests.memory=lots"],
     'cannot read "lots" as a memory size'),
    # AppConfig's rules (router/app_config.py _check_kv_tiers), at render time.
    (["kvTiers.enabled=true", "engine.enablePrefixCaching=false"],
     "kvTiers.enabled: needs engine.enablePrefixCaching"),
    (["kvTiers.enabled=true", "decode.tensorParallelSize=2", "decode.gpusPerReplica=2"],
     "kvTiers.enabled: not supported with decode.tensorParallelSize 2 yet"),
    (["kvTiers.hostBytes=0"], "kvTiers.hostBytes"),
    (["kvTiers.colour=blue"], "colour"),
])
def test_bad_kv_tiers_values_fail_helm_template(helm, sets, message):
    done = run_helm(helm, "template", "pd", str(CHART),
                    *[a for one in sets for a in ("--set", one)])
    assert done.returncode != 0 and message in done.stderr, done.stderr
