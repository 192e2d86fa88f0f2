"""Two engines in one process, KV pushed layer by layer over the local transport: the decode
engine continues exactly where a colocated engine would."""
import pytest

from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model
from tests.support.disagg import Pair

TIMEOUT = 30


@pytest.fixture
def model_dir(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    from tests.support.tiny_models import make_tiny_model

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
