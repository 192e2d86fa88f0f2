"""AppConfig: the `args` contract of the Serve application, and the replicas' Ray resources."""
import re
import subprocess
import sys

import pytest
import yaml

from tests.support import REPO
from pd_cluster.config import EngineConfig
from router.app_config import (AUTO, ROLE_RESOURCE_SHARE, AppConfig, ReplicaResources,
                               replica_actor_options)

SHARE = ROLE_RESOURCE_SHARE



def test_empty_args_give_laptop_defaults():
    config = AppConfig.from_args({})
    assert (config.engine.model, config.mode, config.transport) == ("default", "disaggregated",
                                                                    "nixl")
    assert config.engine == EngineConfig()          # one default per engine field
    assert config.engine.max_num_batched_tokens == 2048
    assert (config.num_prefill, config.num_decode) == (1, 1)
    assert config.prefill_resources == config.decode_resources == AUTO
    assert config.conditional_disagg_threshold == 0
    assert config.routing.policy == "kv_aware" and config.routing.prefill_weight == 1.0
    assert AppConfig.from_args(None) == config


def test_nested_sections_and_explicit_resources_are_parsed():
    config = AppConfig.from_args({
        "num_prefill": 2, "num_decode": 6, "transport": "ray",
        "engine": {"dtype": "bfloat16", "max_model_len": 8192},
        "limits": {"max_queue": 10, "max_prompt_tokens": 4000},
        "routing": {"prefill_weight": 0.5},
        "prefill_resources": {"num_gpus": 1, "resources": {"prefill": 0.01}},
    })
    assert config.limits.max_queue == 10 and config.limits.max_tokens == 4096
    assert config.routing.prefill_weight == 0.5
    assert config.prefill_resources == ReplicaResources(num_gpus=1.0, resources={"prefill": 0.01})
    assert config.decode_resources == AUTO
    assert config.engine.dtype == "bfloat16" and config.engine.max_model_len == 8192


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # Ray Serve's own pydantic use
def test_the_engine_replicas_get_the_engine_mapping_with_max_model_len_resolved(
        default_model_dir):
    pytest.importorskip("ray")
    from router.control.model import replica_engine

    shared = AppConfig.from_args({"engine": {"gpu_memory_utilization": 0.45, "seed": 3},
                                  "prefill_resources": {"num_gpus": 0.5},
                                  "decode_resources": {"num_gpus": 0.5}})
    engine = replica_engine(shared, default_model_dir)
    assert engine.gpu_memory_utilization == 0.45 and engine.seed == 3
    assert engine.max_model_len == 8192            # SmolLM2's context, under the 32768 cap
    assert engine.model_copy(update={"max_model_len": None}) == shared.engine


def test_colocated_mode_defaults_to_no_prefill_replicas():
    assert AppConfig.from_args({"mode": "colocated"}).num_prefill == 0


@pytest.mark.parametrize("args, field", [
    ({"bogus": 1}, "args: unknown key(s) bogus; known keys: engine, mode, "),
    ({"limits": {"max_tokenz": 5}}, "limits: unknown key(s) max_tokenz; known keys: max_tokens"),
    ({"engine": {"blok_size": 16}}, "engine: unknown key(s) blok_size; known keys: model, "),
    ({"block_size": 16}, "args: unknown key(s) block_size"),      # an engine field, at the top
    ("engine: {}", "args:"),
    ({"mode": "split"}, "mode:"),
    ({"transport": "tcp"}, "transport:"),
    ({"num_decode": 0}, "num_decode:"),
    ({"num_prefill": -1}, "num_prefill:"),
    ({"num_prefill": 0}, "num_prefill:"),
    ({"mode": "colocated", "num_prefill": 1}, "num_prefill:"),
    ({"num_decode": True}, "num_decode:"),
    ({"num_decode": 1.5}, "num_decode:"),
    ({"engine": {"model": ""}}, "engine.model:"),
    ({"engine": {"model": "  "}}, "engine.model: must not be blank"),
    ({"engine": {"model": None}}, "engine.model:"),
    ({"engine": None}, "engine:"),
    ({"num_decode": None}, "num_decode:"),
    ({"engine": {"block_size": 12}}, "engine.block_size: must be a power of two, got 12"),
    ({"engine": {"block_size": 0}}, "engine.block_size:"),
    ({"engine": {"dtype": "fp8"}}, "engine.dtype:"),
    ({"engine": {"max_num_batched_tokens": "lots"}}, "engine.max_num_batched_tokens:"),
    ({"engine": {"attention_backend": "flash"}}, "engine.attention_backend:"),
    ({"prefill_failure_policy": "retry"}, "prefill_failure_policy:"),
    ({"engine": {"load_format": "gguf"}}, "engine.load_format:"),
    ({"engine": {"gpu_memory_utilization": 0}}, "engine.gpu_memory_utilization:"),
    ({"engine": {"gpu_memory_utilization": 1.2}}, "engine.gpu_memory_utilization:"),
    ({"engine": {"gpu_memory_utilization": "most"}}, "engine.gpu_memory_utilization:"),
    ({"engine": {"kv_cache_memory_gb": float("inf")}}, "engine.kv_cache_memory_gb:"),
    ({"limits": {"request_timeout_s": 0}}, "limits.request_timeout_s:"),
    ({"limits": {"max_queue": -1}}, "limits.max_queue:"),
    ({"limits": "lots"}, "limits:"),
    ({"routing": {"policy": "magic"}}, "routing.policy:"),
    ({"routing": {"prefill_weight": -1}}, "routing.prefill_weight:"),
    ({"api_key_env": "MY-KEY"}, "api_key_env:"),
    ({"engine": {"max_model_len": 100}, "limits": {"max_tokens": 200}},
     "limits.max_tokens: 200 exceeds engine.max_model_len 100"),
    ({"decode_resources": "gpu"}, "decode_resources:"),
    ({"decode_resources": {"gpus": 1}}, "decode_resources: unknown key(s) gpus"),
    ({"decode_resources": {"resources": {"decode": "x"}}}, "decode_resources.resources.decode:"),
    ({"router_replicas": 0}, "router_replicas:"),
    ({"router_replicas": 2.0}, "router_replicas:"),
    ({"router_autoscaling": 3}, "router_autoscaling:"),
    ({"router_autoscaling": {}}, "router_autoscaling.max_replicas: Field required"),
    ({"router_autoscaling": {"max_replicas": 0}}, "router_autoscaling.max_replicas:"),
    ({"router_autoscaling": {"min_replicas": 0, "max_replicas": 2}},
     "router_autoscaling.min_replicas:"),
    ({"router_autoscaling": {"min_replicas": 3, "max_replicas": 2}},
     "router_autoscaling.max_replicas: must be at least min_replicas (3), got 2"),
    ({"router_autoscaling": {"max_replicas": 4, "initial_replicas": 5}},
     "router_autoscaling.initial_replicas: must be within min_replicas..max_replicas (1..4)"),
    ({"router_autoscaling": {"min_replicas": 2, "max_replicas": 4, "initial_replicas": 1}},
     "router_autoscaling.initial_replicas: must be within min_replicas..max_replicas (2..4)"),
    ({"router_autoscaling": {"max_replicas": 4, "target_ongoing_requests": 0}},
     "router_autoscaling.target_ongoing_requests:"),
    ({"router_autoscaling": {"max_replicas": 4, "downscale_delay_s": -1}},
     "router_autoscaling.downscale_delay_s:"),
    ({"router_autoscaling": {"max_replicas": 4, "metrics_interval_s": 5}},
     "router_autoscaling: unknown key(s) metrics_interval_s; known keys: min_replicas"),
    ({"router_replicas": 3, "router_autoscaling": {"max_replicas": 4}},
     "router_replicas: 3 with router_autoscaling set; leave router_replicas at 1"),
    ({"planner": {"enabled": "yes"}}, "planner.enabled:"),
    ({"planner": {"ttft_ms": 0}}, "planner.ttft_ms:"),
    ({"planner": {"tpot_ms": -5}}, "planner.tpot_ms:"),
    ({"planner": {"percentile": 0}}, "planner.percentile:"),
    ({"planner": {"percentile": 100.5}}, "planner.percentile:"),
    ({"planner": {"gpu_budget": 0}}, "planner.gpu_budget:"),
    ({"planner": {"gpu_budget": "4"}}, "planner.gpu_budget:"),
    ({"planner": {"min_prefill": 0}}, "planner.min_prefill:"),
    ({"planner": {"min_decode": 0}}, "planner.min_decode:"),
    ({"planner": {"interval_s": 0}}, "planner.interval_s:"),
    ({"planner": {"cooldown_s": -1}}, "planner.cooldown_s:"),
    ({"planner": {"calm_intervals": 0}}, "planner.calm_intervals:"),
    ({"planner": {"headroom": 1}}, "planner.headroom:"),
    ({"planner": {"headroom": 0}}, "planner.headroom:"),
    ({"planner": {"drain_timeout_s": 0}}, "planner.drain_timeout_s:"),
    ({"planner": {"profile": ""}}, "planner.profile:"),
    ({"planner": {"interval": 30}}, "planner: unknown key(s) interval; known keys: enabled, "),
    ({"mode": "colocated", "planner": {"enabled": True}},
     "planner: needs disaggregated or pooled mode (mode is colocated"),
    ({"prefill_tensor_parallel_size": 2, "planner": {"enabled": True}},
     "planner: needs one tensor-parallel size for both roles (a flip keeps the engine's "
     "weights, sharded one way); prefill_tensor_parallel_size is 2, "
     "engine.tensor_parallel_size 1"),
    ({"planner": {"enabled": True, "min_prefill": 3, "max_prefill": 2}},
     "planner.max_prefill: 2 is below planner.min_prefill 3"),
    ({"num_decode": 2, "planner": {"enabled": True, "min_decode": 3, "max_decode": 2}},
     "planner.max_decode: 2 is below planner.min_decode 3"),
    ({"num_prefill": 3, "planner": {"enabled": True, "max_prefill": 2}},
     "num_prefill: 3 is outside planner.min_prefill..max_prefill (1..2)"),
    ({"num_decode": 1, "planner": {"enabled": True, "min_decode": 2}},
     "num_decode: 1 is outside planner.min_decode..max_decode (2..8)"),
    ({"num_prefill": 2, "num_decode": 2, "planner": {"enabled": True, "gpu_budget": 3}},
     "planner.gpu_budget: 3 is below the 4 GPUs the tiers start with (2 prefill + 2 decode "
     "replicas x tensor-parallel size 1)"),
    ({"engine": {"tensor_parallel_size": 2}, "planner": {"enabled": True, "gpu_budget": 3}},
     "planner.gpu_budget: 3 is below the 4 GPUs the tiers start with"),
])
def test_bad_args_raise_value_error_naming_the_field(args, field):
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        AppConfig.from_args(args)


def test_router_runs_one_replica_by_default():
    config = AppConfig.from_args({})
    assert config.router_replicas == 1 and config.router_autoscaling is None
    assert config.router_deployment_options() == {"num_replicas": 1}


def test_router_replicas_are_serves_num_replicas():
    config = AppConfig.from_args({"router_replicas": 3})
    assert config.router_deployment_options() == {"num_replicas": 3}
    assert config.router_max_replicas == 3


def test_router_autoscaling_is_serves_autoscaling_config_with_our_defaults():
    config = AppConfig.from_args({"router_autoscaling": {"max_replicas": 4}})
    assert config.router_deployment_options() == {"autoscaling_config": {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": None,
        "target_ongoing_requests": 64.0, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0}}
    assert config.router_max_replicas == 4
    # router_replicas may stay written at its default (pd.yaml lists it) beside autoscaling.
    both = AppConfig.from_args({"router_replicas": 1, "router_autoscaling": {"max_replicas": 4}})
    assert both.router_deployment_options() == config.router_deployment_options()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # Ray Serve's own pydantic use
@pytest.mark.parametrize("args", [
    {"router_replicas": 2},
    {"router_autoscaling": {"min_replicas": 2, "max_replicas": 6, "initial_replicas": 3,
                            "target_ongoing_requests": 16, "upscale_delay_s": 0,
                            "downscale_delay_s": 60}},
])
def test_router_deployment_options_are_accepted_by_ray_serve(args):
    """The kwargs go to `OpenAIRouter.options(...)` as they are: Serve's own checks pass."""
    pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import AutoscalingConfig

    options = AppConfig.from_args(args).router_deployment_options()

    @serve.deployment
    class Probe:
        pass

    deployment = Probe.options(**options)
    if "autoscaling_config" in options:
        expected = AutoscalingConfig(**options["autoscaling_config"])
        assert deployment._deployment_config.autoscaling_config == expected
    else:
        assert deployment.num_replicas == options["num_replicas"]


def test_engine_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^block_size: must be a power of two, got 24$"):
        EngineConfig.of(block_size=24)
    with pytest.raises(ValueError, match=r"^EngineConfig: unknown key\(s\) blok_size; known"):
        EngineConfig.of(blok_size=16)
    with pytest.raises(ValueError, match="max_num_seqs"):      # pydantic's own message
        EngineConfig(max_num_seqs=0)


def test_the_config_imports_neither_ray_nor_torch():
    code = ("import sys, router.app_config; "
            "print(sorted({'ray', 'torch'} & {m.split('.')[0] for m in sys.modules}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


SERVE_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                       if p.name != "cluster.yaml")     # the Ray cluster launcher's


@pytest.mark.parametrize("name", SERVE_CONFIGS)
def test_serve_config_args_are_accepted(name):
    serve_config = yaml.safe_load((REPO / "configs" / name).read_text())
    (app,) = serve_config["applications"]
    assert app["import_path"] == "router.app:build_app" and app["route_prefix"] == "/"
    AppConfig.from_args(app["args"])


LAPTOP = {"CPU": 8.0, "memory": 1e10}
GPU_BOX = {"CPU": 64.0, "GPU": 8.0}
GROUPS = {"CPU": 200.0, "GPU": 16.0, "prefill": 8.0, "decode": 8.0}


@pytest.mark.parametrize("cluster, role, expected", [
    (LAPTOP, "prefill", {"num_cpus": 1.0, "num_gpus": 0.0}),
    (GPU_BOX, "decode", {"num_cpus": 1.0, "num_gpus": 1.0}),
    (GROUPS, "prefill", {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"prefill": SHARE}}),
    (GROUPS, "decode", {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"decode": SHARE}}),
    ({"CPU": 4.0, "decode": 1.0}, "decode",
     {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"decode": SHARE}}),
])
def test_auto_resources_follow_what_the_cluster_offers(cluster, role, expected):
    assert replica_actor_options(AppConfig.from_args({}), role, cluster) == expected


def test_auto_cpu_replicas_share_a_small_machine_and_leave_a_cpu_for_the_router():
    config = AppConfig.from_args({"num_prefill": 1, "num_decode": 1})
    assert replica_actor_options(config, "decode", {"CPU": 2.0})["num_cpus"] == 0.5
    config = AppConfig.from_args({"num_prefill": 2, "num_decode": 3})
    assert replica_actor_options(config, "prefill", {"CPU": 2.0})["num_cpus"] == 0.2


def test_auto_cpu_replicas_leave_a_cpu_for_each_router_replica():
    fixed = AppConfig.from_args({"router_replicas": 3})
    assert replica_actor_options(fixed, "decode", {"CPU": 4.0})["num_cpus"] == 0.5
    scaled = AppConfig.from_args({"router_autoscaling": {"max_replicas": 4}})
    assert replica_actor_options(scaled, "decode", {"CPU": 6.0})["num_cpus"] == 1.0
    assert replica_actor_options(scaled, "decode", {"CPU": 5.0})["num_cpus"] == 0.5
    # Too few CPUs for every router replica: the engines still share one.
    assert replica_actor_options(scaled, "decode", {"CPU": 4.0})["num_cpus"] == 0.5
    assert replica_actor_options(scaled, "decode", {"CPU": 1.0})["num_cpus"] == 0.25


def test_explicit_resources_are_used_as_written_whatever_the_cluster():
    config = AppConfig.from_args({"decode_resources": {"num_gpus": 2, "num_cpus": 4,
                                                       "resources": {"big_decode": 1}}})
    expected = {"num_cpus": 4.0, "num_gpus": 2.0, "resources": {"big_decode": 1.0}}
    assert replica_actor_options(config, "decode", LAPTOP) == expected
    assert replica_actor_options(config, "prefill", GROUPS)["resources"] == {"prefill": SHARE}


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role:"):
        replica_actor_options(AppConfig.from_args({}), "router", LAPTOP)


# -- the P:D planner -------------------------------------------------------------------------

def test_planner_is_off_by_default_and_its_rules_only_apply_when_on():
    config = AppConfig.from_args({})
    assert not config.planner.enabled
    assert (config.planner.ttft_ms, config.planner.tpot_ms, config.planner.percentile) == \
        (1000, 50, 90)
    assert config.planner.gpu_budget is None and config.planner.profile is None
    # Off: colocated mode, tiers outside min..max and a small budget are all fine.
    AppConfig.from_args({"mode": "colocated", "num_decode": 12,
                         "planner": {"max_decode": 2, "gpu_budget": 1}})


def test_without_the_planner_the_tiers_are_their_written_sizes():
    config = AppConfig.from_args({"num_prefill": 2, "num_decode": 3,
                                  "planner": {"gpu_budget": 64}})
    assert (config.most_replicas("prefill"), config.most_replicas("decode")) == (2, 3)
    assert config.most_engine_replicas() == 5
    assert config.planner_gpu_budget() == 64           # written, though unused while off
    colocated = AppConfig.from_args({"mode": "colocated", "num_decode": 4})
    assert (colocated.most_replicas("prefill"), colocated.most_engine_replicas()) == (0, 4)


def test_the_planners_budget_defaults_to_the_starting_gpus():
    config = AppConfig.from_args({"num_prefill": 2, "num_decode": 3,
                                  "planner": {"enabled": True}})
    assert config.planner_gpu_budget() == 5
    # min(max_prefill, budget replicas - min_decode) and the mirror image
    assert (config.most_replicas("prefill"), config.most_replicas("decode")) == (4, 4)
    assert config.most_engine_replicas() == 5
    tp = AppConfig.from_args({"num_prefill": 2, "num_decode": 2, "engine":
                              {"tensor_parallel_size": 2}, "planner": {"enabled": True}})
    assert tp.planner_gpu_budget() == 8 and tp.most_engine_replicas() == 4


def test_the_planner_reaches_max_or_what_the_budget_leaves_the_other_tiers_minimum():
    config = AppConfig.from_args({
        "num_prefill": 2, "num_decode": 2, "prefill_tensor_parallel_size": 2,
        "decode_tensor_parallel_size": 2,
        "planner": {"enabled": True, "gpu_budget": 17, "min_prefill": 2, "max_prefill": 3,
                    "min_decode": 1, "max_decode": 8}})
    assert config.planner_gpu_budget() == 17
    assert config.most_engine_replicas() == 8         # 17 GPUs hold 8 replicas of 2
    assert config.most_replicas("prefill") == 3       # max_prefill
    assert config.most_replicas("decode") == 6        # 8 - min_prefill 2
    with pytest.raises(ValueError, match="role:"):
        config.most_replicas("router")


def test_planner_settings_are_the_policys_in_seconds_and_gpus():
    from pd_cluster.planner import PlannerSettings

    config = AppConfig.from_args({
        "num_prefill": 2, "num_decode": 2, "engine": {"tensor_parallel_size": 2},
        "planner": {"enabled": True, "ttft_ms": 250, "tpot_ms": 20, "gpu_budget": 12,
                    "min_prefill": 2, "max_prefill": 4, "min_decode": 1, "max_decode": 5,
                    "cooldown_s": 30, "headroom": 0.3, "calm_intervals": 4}})
    assert config.planner_settings() == PlannerSettings(
        ttft_s=0.25, tpot_s=0.02, gpu_budget=12, min_prefill=2, max_prefill=4, min_decode=1,
        max_decode=5, cooldown_s=30.0, headroom=0.3, calm_intervals=4, gpus_per_instance=2)
    default = AppConfig.from_args({"planner": {"enabled": True}}).planner_settings()
    assert (default.ttft_s, default.tpot_s, default.gpu_budget, default.cooldown_s) == \
        (1.0, 0.05, 2, 120.0)


def test_auto_cpu_replicas_leave_room_for_the_engines_the_planner_may_add():
    fixed = AppConfig.from_args({"num_prefill": 1, "num_decode": 1})
    assert replica_actor_options(fixed, "decode", {"CPU": 5.0})["num_cpus"] == 1.0
    planned = AppConfig.from_args({"num_prefill": 1, "num_decode": 1,
                                   "planner": {"enabled": True, "gpu_budget": 8}})
    assert planned.most_engine_replicas() == 8
    assert replica_actor_options(planned, "decode", {"CPU": 5.0})["num_cpus"] == 0.5
    assert replica_actor_options(planned, "prefill", {"CPU": 9.0})["num_cpus"] == 1.0
