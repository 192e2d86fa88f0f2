"""Engine node groups on a three-node Ray cluster of one machine, shaped as configs/cluster.yaml
shapes them (a head; a `prefill` and a `decode` node of one CPU each):

- the router and controller replicas' options (router/app.py) put them on the head, so a
  router never takes the CPU an engine of its node asks for, and both engines, with their
  "auto" options, are placed on their own nodes;
- an engine that does not fit is named with what each node that could take it has free
  (router/control/placement.py), not a sum over all nodes.
"""
from __future__ import annotations

import pytest

pytest.importorskip("ray")
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.support.ray_cluster import RAY_WORKER_ENV, environ  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

PLACED_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def three_nodes(own_ray):
    """Node id by name: the head (1 CPU), a prefill and a decode node (1 CPU each)."""
    with environ(RAY_WORKER_ENV):
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False))
        nodes = {role: cluster.add_node(num_cpus=1, resources={role: 1},
                                        object_store_memory=80 * 2**20)
                 for role in ("prefill", "decode")}
    ray.init(address=cluster.address, log_to_driver=False)
    ids = {"head": cluster.head_node.node_id,
           **{role: node.node_id for role, node in nodes.items()}}
    yield ids
    ray.shutdown()
    cluster.shutdown()


@ray.remote
class Where:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_routers_go_on_the_head_and_engines_get_their_nodes(three_nodes):
    from pd_cluster.role import Role
    from router.app import HEAD_NODE_RESOURCE, head_of_engine_groups, router_cpus
    from router.app_config import AppConfig, replica_actor_options
    config = AppConfig.from_args({"num_prefill": 1, "num_decode": 1})
    resources = ray.cluster_resources()
    engines = {role: replica_actor_options(config, role, resources) for role in Role}
    head = head_of_engine_groups(resources)
    assert head is not None and head["CPU"] == 1
    cpus = router_cpus(config, config.router_max_replicas, resources, engines, head)
    # The router first, as Serve may place it before the controller starts any engine.
    router = Where.options(num_cpus=cpus, resources={HEAD_NODE_RESOURCE: 0.001}).remote()
    actors = {"router": router}
    try:
        assert ray.get(router.node.remote(), timeout=PLACED_WITHIN_S) == three_nodes["head"]
        for role in Role:
            actors[str(role)] = Where.options(**engines[role]).remote()
        where = {name: ray.get(a.node.remote(), timeout=PLACED_WITHIN_S)
                 for name, a in actors.items()}
        assert where == {"router": three_nodes["head"], "prefill": three_nodes["prefill"],
                         "decode": three_nodes["decode"]}
    finally:
        for actor in actors.values():
            ray.kill(actor)


def test_unplaced_engine_is_named_with_what_each_node_of_its_group_has_free(three_nodes):
    from router.control.placement import ray_actor_placed, unplaced_reason
    options = {"num_cpus": 1, "num_gpus": 0, "resources": {"decode": 0.01}}
    holder = Where.options(**options).remote()        # takes the decode node's only CPU
    ray.get(holder.node.remote(), timeout=PLACED_WITHIN_S)
    waiting = Where.options(**options).remote()
    try:
        assert not ray_actor_placed(waiting._actor_id.hex())
        def full() -> str | None:
            reason = unplaced_reason(options)
            return reason if "CPU: 0," in reason else None
        reason = wait_until(full, 10, 0.2, "the decode node's free CPUs at 0 in the reason")
        decode = three_nodes["decode"][:8]
        assert "the nodes that could take it are full (free now: node " in reason
        assert f"{decode} {{CPU: 0, decode: 0.99}})" in reason, reason
        for other in ("head", "prefill"):
            assert three_nodes[other][:8] not in reason, reason
    finally:
        for actor in (holder, waiting):
            ray.kill(actor)
