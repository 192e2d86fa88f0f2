"""AppConfig: the `args` contract of the Serve application, and the replicas' Ray resources."""
import re
from pathlib import Path

import pytest
import yaml

from router.app_config import AUTO, POOL_SHARE, AppConfig, ReplicaResources, replica_actor_options

REPO = Path(__file__).resolve().parents[1]


def test_empty_args_give_laptop_defaults():
    config = AppConfig.from_args({})
    assert (config.model, config.mode, config.transport) == ("default", "disaggregated", "nixl")
    assert (config.num_prefill, config.num_decode) == (1, 1)
    assert config.prefill_resources == config.decode_resources == AUTO
    assert config.conditional_disagg_threshold == 0
    assert config.routing.policy == "kv_aware" and config.routing.prefill_weight == 1.0
    assert AppConfig.from_args(None) == config


def test_nested_sections_and_explicit_resources_are_parsed():
    config = AppConfig.from_args({
        "num_prefill": 2, "num_decode": 6, "transport": "ray", "dtype": "bfloat16",
        "max_model_len": 8192, "limits": {"max_queue": 10, "max_prompt_tokens": 4000},
        "routing": {"prefill_weight": 0.5},
        "prefill_resources": {"num_gpus": 1, "resources": {"prefill": 0.01}},
    })
    assert config.limits.max_queue == 10 and config.limits.max_tokens == 4096
    assert config.routing.prefill_weight == 0.5
    assert config.prefill_resources == ReplicaResources(1.0, 1.0, {"prefill": 0.01})
    assert config.decode_resources == AUTO


def test_gpu_memory_utilization_reaches_every_engine():
    from router.app import engine_config
    assert AppConfig.from_args({}).gpu_memory_utilization == 0.85
    shared = AppConfig.from_args({"gpu_memory_utilization": 0.45,
                                  "prefill_resources": {"num_gpus": 0.5},
                                  "decode_resources": {"num_gpus": 0.5}})
    assert engine_config(shared, 4096).gpu_memory_utilization == 0.45


def test_colocated_mode_defaults_to_no_prefill_replicas():
    assert AppConfig.from_args({"mode": "colocated"}).num_prefill == 0


@pytest.mark.parametrize("args, field", [
    ({"bogus": 1}, "args: unknown key(s) bogus"),
    ({"limits": {"max_tokenz": 5}}, "limits: unknown key(s) max_tokenz"),
    ({"mode": "split"}, "mode:"),
    ({"transport": "tcp"}, "transport:"),
    ({"num_decode": 0}, "num_decode:"),
    ({"num_prefill": -1}, "num_prefill:"),
    ({"num_prefill": 0}, "num_prefill:"),
    ({"mode": "colocated", "num_prefill": 1}, "num_prefill:"),
    ({"num_decode": True}, "num_decode:"),
    ({"num_decode": 1.5}, "num_decode:"),
    ({"model": ""}, "model:"),
    ({"model": None}, "model:"),
    ({"num_decode": None}, "num_decode:"),
    ({"block_size": 12}, "block_size:"),
    ({"dtype": "fp8"}, "dtype:"),
    ({"prefill_failure_policy": "retry"}, "prefill_failure_policy:"),
    ({"load_format": "gguf"}, "load_format:"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization:"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization:"),
    ({"gpu_memory_utilization": "most"}, "gpu_memory_utilization:"),
    ({"limits": {"request_timeout_s": 0}}, "limits.request_timeout_s:"),
    ({"limits": "lots"}, "limits:"),
    ({"routing": {"policy": "magic"}}, "routing.policy:"),
    ({"routing": {"prefill_weight": -1}}, "routing.prefill_weight:"),
    ({"api_key_env": "MY-KEY"}, "api_key_env:"),
    ({"max_model_len": 100, "limits": {"max_tokens": 200}}, "limits.max_tokens:"),
    ({"decode_resources": "gpu"}, "decode_resources:"),
    ({"decode_resources": {"gpus": 1}}, "decode_resources: unknown key(s) gpus"),
    ({"decode_resources": {"resources": {"decode": "x"}}}, "decode_resources.resources.decode:"),
])
def test_bad_args_raise_value_error_naming_the_field(args, field):
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        AppConfig.from_args(args)


def test_pd_yaml_args_are_accepted():
    serve_config = yaml.safe_load((REPO / "configs" / "pd.yaml").read_text())
    (app,) = serve_config["applications"]
    assert app["import_path"] == "router.app:build_app" and app["route_prefix"] == "/"
    AppConfig.from_args(app["args"])


LAPTOP = {"CPU": 8.0, "memory": 1e10}
GPU_BOX = {"CPU": 64.0, "GPU": 8.0}
POOLS = {"CPU": 200.0, "GPU": 16.0, "prefill": 8.0, "decode": 8.0}


@pytest.mark.parametrize("cluster, role, expected", [
    (LAPTOP, "prefill", {"num_cpus": 1.0, "num_gpus": 0.0}),
    (GPU_BOX, "decode", {"num_cpus": 1.0, "num_gpus": 1.0}),
    (POOLS, "prefill", {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"prefill": POOL_SHARE}}),
    (POOLS, "decode", {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"decode": POOL_SHARE}}),
    ({"CPU": 4.0, "decode": 1.0}, "decode",
     {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"decode": POOL_SHARE}}),
])
def test_auto_resources_follow_what_the_cluster_offers(cluster, role, expected):
    assert replica_actor_options(AppConfig.from_args({}), role, cluster) == expected


def test_auto_cpu_replicas_share_a_small_machine_and_leave_a_cpu_for_the_router():
    config = AppConfig.from_args({"num_prefill": 1, "num_decode": 1})
    assert replica_actor_options(config, "decode", {"CPU": 2.0})["num_cpus"] == 0.5
    config = AppConfig.from_args({"num_prefill": 2, "num_decode": 3})
    assert replica_actor_options(config, "prefill", {"CPU": 2.0})["num_cpus"] == 0.2


def test_explicit_resources_are_used_as_written_whatever_the_cluster():
    config = AppConfig.from_args({"decode_resources": {"num_gpus": 2, "num_cpus": 4,
                                                       "resources": {"big_decode": 1}}})
    expected = {"num_cpus": 4.0, "num_gpus": 2.0, "resources": {"big_decode": 1.0}}
    assert replica_actor_options(config, "decode", LAPTOP) == expected
    assert replica_actor_options(config, "prefill", POOLS)["resources"] == {"prefill": POOL_SHARE}


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role:"):
        replica_actor_options(AppConfig.from_args({}), "router", LAPTOP)
