"""Scheduler: token budget, decodes first, abort anywhere, all blocks free at the end."""
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.request import RequestStatus
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tiny_model_root):
    return LLM(make_tiny_model("llama_gqa", tiny_model_root), block_size=4, num_kv_blocks=32,
               max_num_batched_tokens=10)


def _drain(engine):
    while engine.has_unfinished():
        engine.step()


def test_steps_respect_budget_and_put_decodes_first(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p in ([1] * 23, [2] * 7, [3] * 15):
        engine.add_request(p, params)
    seen = []
    schedule = engine.scheduler.schedule

    def checked_schedule():
        plan = schedule()
        assert plan.num_tokens <= 10
        decodes = [s.request.num_tokens - s.request.num_computed_tokens == 1
                   for s in plan.scheduled]
        assert decodes == sorted(decodes, reverse=True), "decodes must come first"
        assert all(s.num_tokens >= 1 for s in plan.scheduled)
        seen.append(len(set(decodes)) == 2)
        return plan

    engine.scheduler.schedule = checked_schedule
    try:
        _drain(engine)
    finally:
        del engine.scheduler.schedule
    seen_mixed = any(seen)
    assert seen_mixed, "expected a step mixing decodes and a prefill chunk"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("after_steps", [0, 1, 3, 8])
def test_abort_at_any_point_frees_blocks(llm, after_steps):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request([7] * 30, params), engine.add_request([8] * 5, params),
           engine.add_request([9] * 12, params)]
    for _ in range(after_steps):
        engine.step()
    aborted = engine.scheduler.requests[ids[0]]
    assert not aborted.is_finished  # it is waiting, prefilling or running, not done
    out = engine.abort(ids[0])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort(ids[0]) is None  # aborting twice is harmless
    _drain(engine)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_of_a_preempted_request_frees_blocks(tiny_model_root):
    llm = LLM(make_tiny_model("llama_gqa", tiny_model_root), block_size=4, num_kv_blocks=12,
              max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [engine.add_request([i] * 8, params) for i in range(1, 5)]
    while engine.scheduler.stats.num_preemptions == 0:
        engine.step()
    preempted = [i for i in ids if engine.scheduler.requests.get(i)
                 and engine.scheduler.requests[i].status is RequestStatus.WAITING]
    assert preempted
    engine.abort(preempted[0])
    _drain(engine)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_request_too_long_for_the_model_or_kv_cache_is_refused(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 600)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request([1] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 10**6])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    assert not engine.has_unfinished()


def test_illegal_status_transition_raises():
    from pd_cluster.request import Request

    req = Request("r", [1], SamplingParams())
    req.move_to(RequestStatus.RUNNING)
    with pytest.raises(RuntimeError, match="RUNNING -> PREFILLING"):
        req.move_to(RequestStatus.PREFILLING)


def test_step_totals_count_every_prompt_token_and_decode_once(tiny_model_root):
    # Chunked under a 10-token budget, prefills beside decodes: whatever the kinds of steps,
    # the work adds up to each prompt prefilled whole (l tokens, l^2 of attention) and each
    # later token decoded once, attending to everything before it.
    engine = LLM(make_tiny_model("llama_gqa", tiny_model_root), block_size=4,
                 max_num_batched_tokens=10).engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    lengths = (23, 7, 15)
    for i, n in enumerate(lengths):
        engine.add_request([10 + i] * n, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    totals = {kind: t.as_dict() for kind, t in engine.step_totals.items()}
    assert all(totals[k]["steps"] > 0 for k in ("prefill", "decode", "mixed")), totals
    assert sum(t["steps"] for t in totals.values()) == steps
    assert all(t["seconds"] > 0 for t in totals.values())
    assert sum(t["sum_tokens"] for t in totals.values()) == sum(lengths)
    assert sum(t["sum_sq_tokens"] for t in totals.values()) == sum(n * n for n in lengths)
    assert sum(t["batch"] for t in totals.values()) == 5 * len(lengths)
    assert sum(t["sum_ctx"] for t in totals.values()) == sum(5 * n + 15 for n in lengths)
    assert totals["prefill"]["batch"] == totals["decode"]["sum_tokens"] == 0
