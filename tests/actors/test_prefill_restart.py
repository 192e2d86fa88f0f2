"""A prefill replica killed under load and restarted as the engine controller restarts it (its
supervised EngineFleet: a new actor in the same slot, same replica id), over each CPU
transport, with the decode replica never restarted: D keeps serving, takes the new P's KV,
drops the dead P's transport metadata (transfer/peers.py), every output equals the fault-free
reference, and D holds no KV block at the end. A late descriptor of the dead P (a result it
sent before it died) is not connected again."""
from __future__ import annotations

import asyncio

import pytest
import ray

from actors.engine_actor import EngineActor
from actors.handoff import PushHandoff
from pd_cluster import LLM, EngineConfig, SamplingParams
from pd_cluster.role import Role
from router.control.fleet import EngineFleet
from router.control.membership import ReplicaState
from router.disagg_client import DisaggregatedClient
from router.routing import Route
from tests.support.engine_clients import collect, prefilled_tokens, prefilling
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_until_async
from transfer.messages import KVDescriptor
from transfer.peers import seat_of

pytestmark = pytest.mark.usefixtures("ray_cluster")

TRANSPORTS = ["nixl", "ucx", "ray"]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Prompts of 3-5 prefill chunks (16 tokens a step), so that the kill finds P mid-prefill.
BEFORE = [list(range(5 + i, 53 + i + 8 * (i % 3))) for i in range(6)]   # running at the kill
AFTER = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]     # sent after the restart
# The dead P never says DRAINED, so D fences the blocks it may have written for the transfer
# lease plus a margin (actors/kv_push.py): a short lease keeps that wait short.
TRANSFER_LEASE_S = 3.0
READY_S = 120        # engines loading on a loaded 2-core machine
RESTART_S = 60       # health check, backoff, a new actor loading its model
ALL_S = 300          # a transport's whole run, every Ray call in it included


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    """The tiny llama (GQA) checkpoint the engines load."""
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def reference(tiny):
    """Each prompt's greedy tokens without any fault (one engine, colocated)."""
    outs = LLM(tiny, block_size=16).generate(BEFORE + AFTER, PARAMS)
    return [o.outputs[0].token_ids for o in outs]


def spawner(tiny, transport):
    """The fleet's `spawn(role, replica_id)`: what router/control/engines.py starts, with a
    small KV cache and prefill chunks, and the short transfer lease."""
    cfg = EngineConfig(model=tiny, block_size=16, max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=16)

    def spawn(role: Role, replica_id: int):
        return EngineActor.options(num_cpus=0, max_restarts=0).remote(
            cfg, role, replica_id, transport, 30.0, transfer_lease_s=TRANSFER_LEASE_S)
    return spawn


async def run(client, prompts, tag):
    return [o.outputs[0].token_ids for o in await asyncio.gather(*[
        collect(client, f"{tag}{i}", p, PARAMS, Route(0, 0)) for i, p in enumerate(prompts)])]


async def peers_of(actor) -> list[str]:
    """The agents the actor's KV transport is connected to."""
    return await actor.__ray_call__.remote(lambda a: sorted(a.end.pump.transport.peers))


async def agent_of(actor) -> str:
    return KVDescriptor.decode(await actor.kv_descriptor.remote()).agent


async def kill_mid_prefill(client, p):
    """Requests of BEFORE, P killed once it is mid-prefill with some of them: their outputs."""
    running = asyncio.ensure_future(run(client, BEFORE, "before"))
    await wait_until_async(lambda: _prefilling(p), 30, 0.01, what="P mid-prefill")
    ray.kill(p, no_restart=True)
    return await asyncio.wait_for(running, 60)


async def _prefilling(p) -> bool:
    return prefilling(await p.load.remote())


async def restarted(fleet, old_id: str):
    """The P slot's new actor, once the fleet has restarted it and joined it to the handoff."""
    slot = fleet.slots[(Role.PREFILL, 0)]
    await wait_until_async(lambda: slot.actor_id != old_id and slot.state is ReplicaState.READY,
                           RESTART_S, 0.1, what="P restarted and ready")
    return slot.actor


async def restart_under_load(tiny, transport, reference):
    fleet = EngineFleet("disaggregated", {Role.PREFILL: 1, Role.DECODE: 1}, PushHandoff(), {},
                        spawner(tiny, transport))
    client = DisaggregatedClient(True, 60.0, fleet)
    try:
        await client.wait_ready(READY_S)
        (old_p,), (d,) = client.prefill, client.decode
        old_descriptor = await old_p.kv_descriptor.remote()
        old_agent = KVDescriptor.decode(old_descriptor).agent
        assert await peers_of(d) == [old_agent]

        before = await kill_mid_prefill(client, old_p)
        assert before == reference[:len(BEFORE)]      # finished on D, or prefilled there

        new_p = await restarted(fleet, old_p._actor_id.hex())
        client.update(fleet.membership())
        new_agent = await agent_of(new_p)
        # D was not restarted, and its transport holds the new P in the dead one's stead; the
        # dead one's descriptor, arriving late (a result it sent before it died), stays out.
        assert await peers_of(d) == [new_agent]
        assert seat_of(old_agent) is not None and seat_of(new_agent) == seat_of(old_agent)
        await d.add_peer.remote(old_descriptor)
        assert await peers_of(d) == [new_agent]
        d_prefilled = prefilled_tokens(await d.load.remote())

        assert await asyncio.wait_for(run(client, AFTER, "after"), 60) == reference[len(BEFORE):]
        p_load, d_load = await new_p.load.remote(), await d.load.remote()
        assert prefilled_tokens(p_load) == sum(map(len, AFTER))
        assert p_load.kv_bytes_transferred > 0
        assert prefilled_tokens(d_load) == d_prefilled    # D took the KV, computed none

        # No block leaked on D (those the dead P may have written are freed after its fence).
        await wait_until_async(lambda: _d_free(d), TRANSFER_LEASE_S + 10, 0.2,
                               what="every KV block on D free")
    finally:
        fleet.shutdown()


async def _d_free(d) -> bool:
    load = await d.load.remote()
    return load.kv_blocks_used == 0 and load.num_running == 0


@pytest.fixture(scope="module")
def restarts(tiny, reference):
    """Each transport's restart under load on a deployment of its own, all at once: while one
    waits (the health check, the restart's backoff, D's fence) the others compute. Transport
    → None, or the error that ended its run."""
    async def all_transports():
        return await asyncio.gather(*[asyncio.wait_for(restart_under_load(tiny, t, reference),
                                                       ALL_S)
                                      for t in TRANSPORTS], return_exceptions=True)
    return dict(zip(TRANSPORTS, asyncio.run(all_transports())))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_restarted_under_load_is_rejoined_by_decode(restarts, transport):
    if restarts[transport] is not None:
        raise restarts[transport]

