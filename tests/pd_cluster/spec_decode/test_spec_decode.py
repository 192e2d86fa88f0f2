"""Speculative decoding, colocated: greedy output with speculation equals greedy output
without it, token for token, and the KV of rejected drafts never outlives its step."""
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.spec_decode.ngram import propose_ngram
from tests.support.tiny_models import make_tiny_model, mixed_prompts
from tests.support.spec_decode import GREEDY, NEW_TOKENS, loopy_model

# Block size 4 and a 7-token budget chunk every longer prompt (and cap a step's drafts); 40
# blocks (160 tokens) cannot hold 8 sequences of up to 85 tokens, so requests get preempted.
SMALL = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=7)


def test_ngram_proposes_the_continuation_of_the_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert propose_ngram([1, 2, 9, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]   # latest match
    assert propose_ngram([5, 5, 5, 5, 5, 5], 3, 2, 3) == [5, 5, 5]   # followed by k tokens
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_gqa", "qwen3_qknorm"])
def test_ngram_greedy_equals_plain_with_chunking_and_preemption(family, tiny_model_root):
    model_dir = loopy_model(family, tiny_model_root)
    prompts = mixed_prompts()
    plain = LLM(model_dir, **SMALL).generate(prompts, GREEDY)
    llm = LLM(model_dir, **SMALL, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                               "max_batch_size": 8})
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec.stats
    assert stats.accepted > 0 and stats.accepted < stats.proposed
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.slow
def test_async_scheduling_speculates_and_equals_plain(tiny_model_root):
    """Under async scheduling (the GPU default) a step is in flight when the next is
    planned: speculation collects it first, then proposes; the output is unchanged, stop
    tokens and aborts included."""
    model_dir = loopy_model("llama_gqa", tiny_model_root)
    prompts = mixed_prompts()
    plain = LLM(model_dir, **SMALL).generate(prompts, GREEDY)
    stop = plain[0].outputs[0].token_ids[30]
    params = [GREEDY] * 7 + [SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                            stop_token_ids=[stop])]
    expected = LLM(model_dir, **SMALL).generate(prompts, params)
    llm = LLM(model_dir, **SMALL, async_scheduling=True,
              speculative={"method": "ngram", "max_batch_size": 8})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert outs[7].outputs[0].finish_reason == expected[7].outputs[0].finish_reason
    assert llm.engine.spec.stats.accepted > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.slow
def test_rejected_drafts_leave_no_blocks_and_no_cached_hashes(tiny_model_root):
    """Between steps a speculating sequence holds no block past its tokens, and the
    prefix cache only ever indexes kept tokens: a prompt made of an earlier prompt + output
    reuses those blocks and continues exactly as an engine that never speculated."""
    model_dir = loopy_model("llama_gqa", tiny_model_root)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(model_dir, block_size=4, speculative=spec)
    engine = llm.engine
    prompts = mixed_prompts()[:4]
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        for req in engine.scheduler.running:
            held = len(req.block_ids)
            assert engine.kv.blocks_needed(req.num_computed_tokens) <= held
            assert held <= engine.kv.blocks_needed(req.num_tokens)
            assert req.num_computed_tokens == req.num_tokens - 1
    assert engine.spec.stats.proposed > engine.spec.stats.accepted > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks

    longer = [p + outs[f"r{i}"] for i, p in enumerate(prompts)]
    again = llm.generate(longer, GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again)
    plain = LLM(model_dir, block_size=4).generate(longer, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.slow
def test_big_batch_and_low_acceptance_fall_back_to_plain_decoding(tiny_model_root):
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)     # rarely repeats itself
    prompts = mixed_prompts()
    plain = [o.outputs[0].token_ids for o in LLM(model_dir, block_size=4).generate(prompts, GREEDY)]
    for spec, counter in [({"max_batch_size": 2}, "batch_fallbacks"),
                          ({"min_acceptance_rate": 0.5, "min_steps_before_fallback": 2},
                           "seq_fallbacks")]:
        llm = LLM(model_dir, block_size=4, speculative={"method": "ngram",
                                                        "prompt_lookup_min": 1, **spec})
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == plain
        # 8 sequences > 2: plain steps; unigram drafts of a random model: mostly rejected.
        assert getattr(llm.engine.spec.stats, counter) > 0, counter


@pytest.mark.slow
@pytest.mark.parametrize("family,draft_family", [("llama_gqa", "llama_gqa"),
                                                 ("qwen3_qknorm", "llama_tied")])
def test_draft_model_greedy_equals_plain_with_chunking_and_preemption(family, draft_family,
                                                                      tiny_model_root):
    """The draft is the target itself (every draft kept), or another tiny model of the same
    vocabulary (nearly every draft rejected, until the sequences fall back)."""
    model_dir = make_tiny_model(family, tiny_model_root)
    draft_dir = make_tiny_model(draft_family, tiny_model_root)
    prompts = mixed_prompts()
    plain = LLM(model_dir, **SMALL).generate(prompts, GREEDY)
    llm = LLM(model_dir, **SMALL, speculative={
        "method": "draft_model", "draft_model": draft_dir, "num_speculative_tokens": 3,
        "draft_num_kv_blocks": 64})
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec.stats
    assert stats.proposed > 0
    if draft_dir == model_dir:
        assert stats.accepted == stats.proposed
        assert sum(o.spec_accepted_tokens for o in outs) == stats.accepted
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert llm.engine.spec.draft.kv.num_free_blocks == 64    # every mirror freed


@pytest.mark.slow
def test_stop_strings_end_a_speculative_step_where_plain_decoding_stops(default_model_dir):
    """A verification step emits several tokens; a stop string completed by one of them ends
    the output there (tokens, text and finish reason as without speculation)."""
    text = "one two three four five six seven eight nine ten eleven twelve thirteen"
    prompt = f"Repeat this text exactly: {text}\n\n{text}\n\n{text}"
    plain_llm = LLM(default_model_dir, num_kv_blocks=64)
    spec_llm = LLM(default_model_dir, num_kv_blocks=64,
                   speculative={"method": "ngram", "num_speculative_tokens": 6})
    free = SamplingParams(temperature=0, max_tokens=24)
    full = plain_llm.generate([prompt], free)[0].outputs[0]
    words = full.text.split()
    assert len(words) > 8, full.text
    for stop in (words[5], words[7] + " " + words[8][:2]):
        params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
        plain = plain_llm.generate([prompt], params)[0]
        spec = spec_llm.generate([prompt], params)[0]
        assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
        assert spec.outputs[0].text == plain.outputs[0].text
        assert spec.outputs[0].finish_reason == plain.outputs[0].finish_reason == "stop"
    assert spec_llm.engine.spec.stats.accepted > 0


def test_grammar_penalties_and_logprobs_stay_plain(tiny_model_root):
    """`can_speculate` is the one predicate: requests whose logits or outputs verification
    does not reproduce decode plainly, in the same batch as speculating ones, and their
    output is what a non-speculating engine gives."""
    from pd_cluster.request import Request
    from pd_cluster.spec_decode.decoder import can_speculate
    from pd_cluster.structured.spec import GrammarKind, GrammarSpec

    model_dir = loopy_model("llama_gqa", tiny_model_root)
    prompts = mixed_prompts()[:4]
    params = [GREEDY,
              SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             logit_bias={7: 2.0}),
              SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)]
    plain = LLM(model_dir, block_size=4).generate(prompts, params)
    outs = LLM(model_dir, block_size=4, speculative={"method": "ngram"}).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    for got, want in zip(outs[3].outputs[0].logprobs, plain[3].outputs[0].logprobs):
        assert got.keys() == want.keys()     # batch shapes differ: values up to rounding
        assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
    assert outs[0].spec_proposed_tokens > 0
    assert [o.spec_proposed_tokens for o in outs[1:]] == [0, 0, 0]
    grammar = SamplingParams(temperature=0, grammar=GrammarSpec(GrammarKind.REGEX, "[ab]+"))
    assert not can_speculate(Request("g", [1, 2], grammar))
    assert can_speculate(Request("p", [1, 2], SamplingParams(temperature=0)))
