"""configs/cluster.yaml: valid for Ray's cluster launcher, with one GPU pool per engine role."""
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.support import REPO
from pd_cluster.role import Role
from router.app_config import ROLE_RESOURCE_SHARE, AppConfig, replica_actor_options

GPUS_PER_INSTANCE = {"p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8, "g6e.48xlarge": 8}


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((REPO / "configs" / "cluster.yaml").read_text())


def test_validates_against_the_schema_shipped_in_ray(cluster):
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)


def test_passes_the_checks_ray_up_runs_before_touching_the_cloud(cluster):
    validate_config(prepare_config(cluster))


def test_each_role_has_its_own_gpu_pool_and_the_head_has_none(cluster):
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert not set(head["resources"]) & set(Role)
    assert head["node_config"]["InstanceType"] not in GPUS_PER_INSTANCE
    for role in Role:
        (pool,) = [t for t in types.values() if role in t["resources"]]
        gpus = GPUS_PER_INSTANCE[pool["node_config"]["InstanceType"]]
        assert pool["resources"] == {role: gpus}       # one unit per GPU
        assert 1 <= pool["min_workers"] <= pool["max_workers"]
    assert sum(t.get("max_workers", 0) for t in types.values()) <= cluster["max_workers"]


def test_auto_resources_pin_replicas_to_the_pools_once_they_have_joined(cluster):
    offered = {"CPU": 16.0}
    for node_type in cluster["available_node_types"].values():
        gpus = GPUS_PER_INSTANCE.get(node_type["node_config"]["InstanceType"], 0)
        for _ in range(node_type.get("min_workers", 0)):
            offered["GPU"] = offered.get("GPU", 0) + gpus
            for name, amount in node_type["resources"].items():
                offered[name] = offered.get(name, 0) + amount
    config = AppConfig.from_args({})
    for role in Role:
        assert replica_actor_options(config, role, offered) == {
            "num_cpus": 1.0, "num_gpus": 1.0, "resources": {role: ROLE_RESOURCE_SHARE}}


def test_setup_installs_the_project_synced_by_file_mounts(cluster):
    assert cluster["file_mounts"] == {"~/pd-cluster": "."}
    assert 'pip install -e "$HOME/pd-cluster[gpu]"' in cluster["setup_commands"]
    assert any("--autoscaling-config=~/ray_bootstrap_config.yaml" in c
               for c in cluster["head_start_ray_commands"])
