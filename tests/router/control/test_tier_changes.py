"""The fleet's tier changes (router/control/tier_changes.py) with real Ray actors and NIXL over host
memory: a prefill replica becomes a decode one and back under load (EngineActor.set_role
through EngineFleet.flip), with no failed request, outputs equal to colocated, the same
actor and no model reload, its KV cache empty before the new role starts; a busy replica
refuses to switch; an added decode replica joins the KV handoff and serves. (Drains:
tests/actors/test_disagg_actors.py; the planner making these changes: tests/router/control/test_elastic_tiers.py.)"""
from __future__ import annotations

import asyncio

import pytest

from tests.support.engine_clients import collect, prefilling
from pd_cluster import LLM, SamplingParams
from router.app_config import AppConfig
from router.routing import Route
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until_async

ray = pytest.importorskip("ray")
from router.control.model import replica_engine  # noqa: E402
from router.disagg_client import DisaggregatedClient  # noqa: E402
from tests.support.disagg import load_of, shutdown, start, wait_all_free  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


def states(fleet) -> dict:
    return {(m.role, m.replica_id): str(m.state) for m in fleet.membership().members}


def test_prefill_replica_becomes_decode_and_back_without_reloading(tiny):
    prompts = [list(range(5, 5 + 120 + 9 * i)) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, PARAMS)]
    client = start(tiny, "nixl", num_p=2, max_num_batched_tokens=16)
    fleet, p1 = client.fleet, client.prefill[1]
    actor_id = p1._actor_id.hex()
    try:
        async def flip_under_load():
            # Half the prompts prefill on P1 while it is told to change roles.
            streams = [asyncio.ensure_future(collect(client, f"a{i}", p, PARAMS,
                                                     Route(0, i % 2)))
                       for i, p in enumerate(prompts)]
            await wait_until_async(lambda: _prefilling(p1), 60, 0.02)
            key = await fleet.flip("prefill", 1, 60)
            outs = await asyncio.gather(*streams)
            await fleet.wait_serving(60)
            return key, outs
        key, outs = asyncio.run(flip_under_load())
        assert [o.outputs[0].token_ids for o in outs] == expected       # none failed
        assert key == ("decode", 1)
        assert states(fleet) == {("prefill", 0): "ready", ("prefill", 1): "retired",
                                 ("decode", 0): "ready", ("decode", 1): "ready"}
        change = fleet.role_changes[-1]
        assert (change.old, change.new, change.actor_id) == (("prefill", 1), key, actor_id)
        # Drained, it still held its prompts' prefixes; switched, its KV pool was empty.
        assert change.idle.kv_blocks_used == 0 and change.idle.kv_blocks_cached > 0
        assert change.switched.kv_blocks_used == 0 and change.switched.kv_blocks_cached == 0
        assert (change.switched.role, change.switched.replica_id) == ("decode", 1)
        load = load_of(p1)
        assert (load.role, load.model_loads) == ("decode", 1)           # no reload

        # It decodes now: every request through it (P0 -> D1) equals colocated.
        client.update(fleet.membership())
        assert client.decode[1] is not None and client.decode[1]._actor_id.hex() == actor_id
        outs = asyncio.run(_run(client, prompts, lambda i: Route(1, 0)))
        assert outs == expected

        # And back: it becomes prefill-2 (ids are never reused) and prefills for D0.
        key = asyncio.run(_flip_and_wait(fleet, "decode", 1))
        assert key == ("prefill", 2)
        client.update(fleet.membership())
        outs = asyncio.run(_run(client, prompts, lambda i: Route(0, 2)))
        assert outs == expected
        load = load_of(p1)
        assert (load.role, load.replica_id, load.model_loads) == ("prefill", 2, 1)
        assert [c.actor_id for c in fleet.role_changes] == [actor_id, actor_id]
        wait_all_free(client, 5.0)
    finally:
        shutdown(client)


@pytest.fixture(scope="module")
def grown(tiny):
    """A fleet of its own (1 P + 1 D, EngineFleet.for_app) grown by one decode replica
    (EngineFleet.add), its client following it: (the client, the added replica's key). The
    added replica's test checks the growth; the busy replica's test then uses the same 1 P +
    2 D (starting engine actors takes seconds each on 2 cores)."""
    config = AppConfig.from_args({"engine": {"model": tiny, "block_size": 16},
                                  "transport": "nixl"})
    options = {role: {"num_cpus": 0} for role in ("prefill", "decode")}
    client = DisaggregatedClient.start(config, replica_engine(config, tiny), options)
    try:
        async def go():
            await client.wait_ready(120)
            key = client.fleet.add("decode")
            client.update(await client.fleet.wait_serving(120))
            return key
        yield client, asyncio.run(go())
    finally:
        shutdown(client)


def test_an_added_decode_replica_joins_the_handoff_and_serves(tiny, grown):
    client, key = grown
    prompts = [list(range(5, 5 + 40 + 7 * i)) for i in range(3)]
    expected = [o.outputs[0].token_ids for o in LLM(tiny).generate(prompts, PARAMS)]
    outs = asyncio.run(_run(client, prompts, lambda i: Route(1, 0)))
    assert key == ("decode", 1) and client.fleet.targets == {"prefill": 1, "decode": 2}
    assert outs == expected
    assert load_of(client.decode[1]).num_running == 0


def test_a_busy_replica_refuses_to_change_roles(tiny, grown):
    """set_role on an engine holding KV (a reservation waiting for its prompt's KV) raises and
    leaves it serving its role; the fleet gives a flip up at its timeout, READY again."""
    client, _ = grown
    fleet, d1 = client.fleet, client.decode[1]
    dest = ray.get(d1.reserve.remote("held", list(range(5, 60)), PARAMS), timeout=30)
    assert dest is not None
    with pytest.raises(ray.exceptions.RayTaskError, match="not idle"):
        ray.get(d1.set_role.remote("prefill", 9), timeout=30)
    key = asyncio.run(fleet.flip("decode", 1, 3.0))        # gives up: still holding
    assert key is None
    assert states(fleet)[("decode", 1)] == "ready"
    assert load_of(d1).role == "decode" and ("prefill", 1) not in fleet.slots
    ray.get(d1.abort.remote("held"), timeout=30)
    outs = asyncio.run(_run(client, [list(range(5, 60))], lambda i: Route(1, 0)))
    assert outs == [LLM(tiny).generate([list(range(5, 60))], PARAMS)[0]
                    .outputs[0].token_ids]


async def _prefilling(actor) -> bool:
    return prefilling(await actor.load.remote())


async def _run(client, prompts, route):
    outs = await asyncio.gather(*[collect(client, f"r{route(i)}{i}", p, PARAMS, route(i))
                                  for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in outs]


async def _flip_and_wait(fleet, role, replica_id):
    key = await fleet.flip(role, replica_id, 60)
    await fleet.wait_serving(60)
    return key
