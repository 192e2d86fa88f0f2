"""Async scheduling (the GPU default) gives exactly the outputs of one-step-at-a-time
scheduling. On a CPU it is off by default, so it is forced on here: same requests, same
engine settings, every feature whose bookkeeping it defers (stop tokens found a step late,
seeded sampling, logprobs, preemption, prefix hits, aborts while a step is in flight)."""
import pytest

from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model, mixed_prompts


def _params(stop_token: int | None) -> list[SamplingParams]:
    stop = [stop_token] if stop_token is not None else []
    return [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stop),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=25, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=35, ignore_eos=True,
                           stop_token_ids=stop),
            SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=stop),
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]


def _run(model_dir: str, async_scheduling: bool, stop_token: int | None):
    llm = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_batched_tokens=7,
              async_scheduling=async_scheduling)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(mixed_prompts(), _params(stop_token))]
    victim = engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=30))
    outs, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        if steps == 9:   # a step is in flight now (async): abort mid-stream
            engine.abort(victim)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.scheduler.stats.num_preemptions > 0
    return [(outs[i].outputs[0].token_ids, outs[i].outputs[0].finish_reason,
             outs[i].outputs[0].logprobs) for i in ids]


@pytest.mark.slow
def test_async_scheduling_matches_one_step_at_a_time(tiny_model_root):
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    # A stop token the greedy stream actually produces, so a request stops mid-stream and
    # the async engine has computed one token past it.
    first = _run(model_dir, False, None)
    stop_token = first[1][0][4]
    sync = _run(model_dir, False, stop_token)
    assert sync[1][1] == "stop"
    pipelined = _run(model_dir, True, stop_token)
    assert [(t, r) for t, r, _ in pipelined] == [(t, r) for t, r, _ in sync]
    # Logprobs: the same tokens; values may differ in the last float bits, as the batches
    # (and so the reduction orders) of the two runs differ.
    for (_, _, lp_a), (_, _, lp_s) in zip(pipelined, sync):
        assert (lp_a is None) == (lp_s is None)
        for a, s in zip(lp_a or [], lp_s or []):
            assert a.keys() == s.keys() and all(abs(a[k] - s[k]) < 1e-4 for k in a)


def test_warm_up_leaves_no_trace(tiny_model_root):
    """The throwaway requests that compile kernels before serving (run on GPU at start) leave
    no request, no held block, no prefix-cache entry and no counted hit behind, and the
    engine's answers afterwards are a fresh engine's."""
    d = make_tiny_model("qwen3_qknorm", tiny_model_root)
    prompts = [list(range(3, 40)), [7, 8, 9]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fresh, warmed = (LLM(d, max_num_batched_tokens=16) for _ in range(2))
    engine = warmed.engine
    engine.warm_up()
    assert not engine.has_unfinished() and not engine.scheduler.requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.kv.allocator._by_hash
    assert engine.scheduler.stats.prefix_queries == engine.scheduler.stats.prefix_hits == 0
    assert ([o.outputs[0].token_ids for o in warmed.generate(prompts, greedy)]
            == [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy)])
