"""One KV pool per node, on two Ray nodes of one machine (ray.cluster_utils.Cluster): blocks put
through node A's pool are found and read by engines on node B (through the transport), while
engines on a pool's own node copy through its shared memory."""
from __future__ import annotations

import asyncio
import random

import pytest

from tests.support.engine_clients import collect, prefilled_tokens
from pd_cluster import LLM, EngineConfig, SamplingParams
from tests.support.ray_cluster import RAY_WORKER_ENV, environ
from router.routing import Route
from tests.support.tiny_models import make_tiny_model

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from actors.engine_actor import EngineActor  # noqa: E402
from actors.pool_handoff import PoolHandoff, PoolSettings  # noqa: E402
from router.disagg_client import DisaggregatedClient  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def two_nodes(own_ray):
    """Nodes "a" and "b", each advertising its name as a resource."""
    with environ(RAY_WORKER_ENV):
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, resources={"a": 1}, object_store_memory=80 * 2**20,
            include_dashboard=False))
        cluster.add_node(num_cpus=1, resources={"b": 1}, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def engine(cfg, role, i, node):
    return EngineActor.options(num_cpus=0, resources={node: 0.01}).remote(
        cfg, role, i, "nixl", 30.0)


def test_blocks_put_on_one_nodes_pool_are_read_on_the_other(two_nodes, tiny_model_root):
    tiny = make_tiny_model("llama_gqa", tiny_model_root)
    cfg = EngineConfig(model=tiny, block_size=BS, max_model_len=512, max_num_seqs=8)
    rng = random.Random(3)
    shared = rng.sample(range(3, 500), 4 * BS)
    first, second = shared + [7, 8, 9], shared + rng.sample(range(3, 500), BS + 3)
    cold = [o.outputs[0].token_ids for o in LLM(tiny).generate([first, second], GREEDY)]
    handoff = PoolHandoff(30.0, PoolSettings(placement="per_node"))
    # P0 on node a, P1 and the decoder on node b.
    prefill = [engine(cfg, "prefill", 0, "a"), engine(cfg, "prefill", 1, "b")]
    client = DisaggregatedClient.over(prefill, [engine(cfg, "decode", 0, "b")], True, handoff,
                                      timeout_s=60.0, mode="pooled")
    try:
        asyncio.run(client.wait_ready(180))
        pools = client.handoff.pools
        assert len(pools) == 2
        node_a = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("a"))
        pool_a = pools[node_a]
        (pool_b,) = [p for n, p in pools.items() if n != node_a]

        # P0 puts the prompt into node a's pool (a copy: same node); the decoder on node b
        # reads it from there through the transport.
        out = asyncio.run(collect(client, "n0", first, GREEDY, Route(0, 0)))
        assert out.outputs[0].token_ids == cold[0]
        a = ray.get(pool_a.stats.remote())
        assert a["bytes_in"] == a["bytes_copied"] > 0           # P0's put: copied
        assert a["bytes_out"] > 0                               # the decoder's read: transport

        # P1 on node b finds the 4 shared blocks in node a's pool and reads them instead of
        # computing them, then puts the prompt into its own node's pool.
        before = prefilled_tokens(ray.get(client.prefill[1].load.remote()))
        out = asyncio.run(collect(client, "n1", second, GREEDY, Route(0, 1)))
        assert out.outputs[0].token_ids == cold[1]
        computed = prefilled_tokens(ray.get(client.prefill[1].load.remote())) - before
        assert computed == len(second) - 4 * BS
        assert ray.get(pool_a.stats.remote())["hits"] - a["hits"] >= 4
        # P1 and the decoder share node b with its pool: both copied, nothing took the transport.
        b = ray.get(pool_b.stats.remote())
        assert b["bytes_copied"] == b["bytes_in"] + b["bytes_out"] and b["bytes_out"] > 0
    finally:
        for actor in [*client.prefill, *client.decode, *client.handoff.pools.values()]:
            ray.kill(actor)
