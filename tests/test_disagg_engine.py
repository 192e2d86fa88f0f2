"""Two engines in one process, KV pushed layer by layer over the local transport: the decode
engine continues exactly where a colocated engine would."""
import pytest

from actors.kv_push import KVPusher, expect_transfers
from actors.transport_pump import TransportPump
from pd_cluster import LLM, SamplingParams
from tiny_models import make_tiny_model
from transfer.registry import make_transport

TIMEOUT = 30


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


@pytest.fixture
def model_dir(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


def test_disaggregated_greedy_equals_colocated(model_dir):
    shared = list(range(3, 40))
    prompts = [shared + [41, 42], list(range(50, 57)), shared + [60], [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    colocated = LLM(model_dir, block_size=4).generate(prompts, params)
    pair = Pair(model_dir, block_size=4, max_num_batched_tokens=16)
    try:
        outs, _ = pair.run(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == \
               [o.outputs[0].token_ids for o in colocated]
        # Again: now D holds the shared prefix, so P sends only what D lacks.
        outs, cached = pair.run(prompts[:1], params)
        assert cached["r0"] >= 36
        assert outs[0].outputs[0].token_ids == colocated[0].outputs[0].token_ids
        for eng in (pair.p, pair.d):
            assert eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        pair.close()


def test_seeded_sampling_continues_the_same_stream_across_engines(model_dir):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    prompt = [9, 8, 7, 6, 5, 4]
    colocated = LLM(model_dir, block_size=4).generate([prompt], params)[0].outputs[0].token_ids
    pair = Pair(model_dir, block_size=4)
    try:
        outs, _ = pair.run([prompt], params)
        assert outs[0].outputs[0].token_ids == colocated
    finally:
        pair.close()


def test_layer_transfers_start_before_the_next_layer_finishes(default_model_dir):
    pair = Pair(default_model_dir, block_size=16)
    try:
        prompt = list(range(100, 900))
        pair.run([prompt], SamplingParams(temperature=0, max_tokens=2))
        computed = {layer: t for what, layer, t in pair.pusher.timeline if what == "computed"}
        posted = {layer: t for what, layer, t in pair.pusher.timeline if what == "posted"}
        layers = sorted(computed)
        assert len(layers) == pair.p.model_cfg.num_layers
        overlapped = [posted[i] < computed[i + 1] for i in layers[:-1]]
        assert all(overlapped), overlapped
    finally:
        pair.close()


def test_abort_of_a_held_request_frees_its_blocks(tiny_model_root):
    """Prefill side: a request whose stream ended (first token out, KV held for the transfer)
    can still be aborted; that frees its blocks and reports nothing more."""
    from pd_cluster import LLM, SamplingParams
    from tiny_models import make_tiny_model

    engine = LLM(make_tiny_model("llama_gqa", tiny_model_root), block_size=4,
                 num_kv_blocks=32).engine
    rid = engine.add_request(list(range(3, 20)), SamplingParams(temperature=0, max_tokens=8),
                             hold_kv=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and rid in engine.scheduler.holding
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    assert engine.abort(rid) is None
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
