"""Engines for the disaggregation tests: a P/D client of engine actors over real Ray (started,
its requests run, torn down, and the wait until every KV block is free), and a P and a D
engine in one process joined by local transports (`Pair`)."""
from __future__ import annotations

import asyncio

import ray

from actors.engine_actor import EngineActor
from actors.kv_push import KVPusher, expect_transfers
from actors.messages import ReplicaLoad
from actors.transport_pump import TransportPump
from pd_cluster import LLM, EngineConfig, SamplingParams
from router.disagg_client import DisaggregatedClient
from router.routing import Route
from tests.support.engine_clients import collect
from tests.support.waiting import wait_until
from transfer.registry import make_transport
from transfer.state import LEASE_S

TIMEOUT = 30
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def start(model_dir, transport, num_p=1, num_d=1, recompute=True, lease_s=60.0, handoff=None,
          transfer_lease_s=LEASE_S, **engine):
    cfg = EngineConfig(model=model_dir, block_size=16, **engine)
    p = [EngineActor.options(num_cpus=0).remote(cfg, "prefill", i, transport, 30.0,
                                                transfer_lease_s=transfer_lease_s)
         for i in range(num_p)]
    d = [EngineActor.options(num_cpus=0).remote(cfg, "decode", i, transport, 30.0, lease_s,
                                                transfer_lease_s) for i in range(num_d)]
    client = DisaggregatedClient.over(p, d, recompute, handoff)
    asyncio.run(client.wait_ready(120))
    return client


def run_all(client, prompts, params=GREEDY, routes=None):
    async def go():
        return await asyncio.gather(*[
            collect(client, f"q{i}", p, params, (routes or {}).get(i, Route(0, 0)))
            for i, p in enumerate(prompts)])
    return [o.outputs[0].token_ids for o in asyncio.run(go())]


def all_free(loads) -> bool:
    return bool(loads) and all(ld.kv_blocks_used == 0 and ld.num_running == 0 for ld in loads)


def assert_all_free(client):
    loads = asyncio.run(client.loads())
    assert all_free(loads), loads


def wait_all_free(client, timeout_s: float):
    """Until every live replica holds no block and runs nothing (frees that happen after the
    request's stream has ended: aborts, lease expiry)."""
    try:
        wait_until(lambda: all_free(asyncio.run(client.loads())), timeout_s, 0.1)
    except TimeoutError:
        pass            # the assertion says what is left
    assert_all_free(client)


def load_of(actor) -> ReplicaLoad:
    return ray.get(actor.load.remote())


def shutdown(client):
    for a in client.prefill + client.decode:
        ray.kill(a)


class Pair:
    """A prefill and a decode engine joined by local transports."""

    def __init__(self, model_dir, **engine_kwargs):
        self.p = LLM(model_dir, **engine_kwargs).engine
        self.d = LLM(model_dir, **engine_kwargs).engine
        self.pumps = []
        agents = []
        for eng in (self.p, self.d):
            tr = make_transport("local")
            tr.register(eng.kv_cache, eng.kv_layout)
            self.pumps.append(TransportPump(tr))
            agents.append(tr.descriptor())
        for pump, peer in zip(self.pumps, reversed(agents)):
            pump.call(lambda tr, peer=peer: tr.connect(peer)).result(TIMEOUT)
        self.p_agent, self.d_agent = agents[0].agent, agents[1].agent
        self.pusher = KVPusher(self.pumps[0], self.p.config.block_size, self.p.runner.device)

    def run(self, prompts, params):
        """Every prompt through P then D; returns D's final outputs in order."""
        firsts, cached = {}, {}
        for i, prompt in enumerate(prompts):
            rid, blocks, n = self.d.reserve(prompt, params, request_id=f"r{i}")
            cached[rid] = n
            self.pusher.add(rid, self.d_agent, blocks, n)
            self.p.add_request(prompt, params, request_id=rid, hold_kv=True)
        while self.p.has_unfinished():
            for out in self.p.step(self.pusher):
                firsts[out.request_id] = out
        finals = {}
        for rid, out in firsts.items():
            ids = self.pusher.finish(rid).result(TIMEOUT)
            self.p.release(rid)
            expect_transfers(self.pumps[1], self.p_agent, ids).result(TIMEOUT)
            tok = out.outputs[0].token_ids[0]
            lp = out.outputs[0].logprobs[0] if out.outputs[0].logprobs else None
            first = self.d.resume(rid, tok, lp)
            if first.finished:
                finals[rid] = first
        while self.d.has_unfinished():
            for out in self.d.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[f"r{i}"] for i in range(len(prompts))], cached

    def close(self):
        for pump in self.pumps:
            pump.close()
