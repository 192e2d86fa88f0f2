"""Token masks against the grammar engine: the batched device fill equals the bitmask bit for
bit; a matcher allows exactly the tokens that keep the output in the grammar, then only the
end tokens; a request's pending token (async scheduling) is taken from the step in flight;
a spec carrying an earlier attempt's tokens resumes where that attempt stopped."""
from __future__ import annotations

import pytest
import torch

from pd_cluster.model_runner import LaunchedStep
from pd_cluster.request import Request
from pd_cluster.sampler import Samples
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.structured import GrammarSpec
from pd_cluster.structured.bitmask import apply_bitmask, bitmask_words
from pd_cluster.structured.constraint import GrammarConstraint
from pd_cluster.structured.matcher import GrammarState, GrammarVocabulary


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return GrammarVocabulary(tokenizer.hf, tokenizer.eos_token_ids, len(tokenizer.hf))


def allowed(state: GrammarState, vocab_size: int) -> set[int]:
    from llguidance.torch import fill_next_token_bitmask

    mask = torch.zeros((1, bitmask_words(vocab_size)), dtype=torch.int32)
    fill_next_token_bitmask(state.matcher, mask)
    return {t for t in range(vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def test_the_batched_fill_masks_exactly_the_cleared_bits():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 100, torch.tensor([0, 2, 3])
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32,
                            generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    for k, row in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bitmask[k, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.slow
def test_a_choice_allows_only_prefixes_then_only_the_end(tokenizer, vocab):
    state = GrammarState.start(vocab, GrammarSpec.choice(["yes", "no"]))
    first = allowed(state, vocab.vocab_size)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(s) or "no".startswith(s) for s in texts)
    assert {"y", "n"} <= texts
    state.catch_up(tokenizer.encode("no"))
    assert allowed(state, vocab.vocab_size) == set(tokenizer.eos_token_ids)


def test_a_pending_token_is_read_from_the_step_in_flight(tokenizer, vocab):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"], "additionalProperties": False})
    req = Request("r", [1, 2, 3], SamplingParams(grammar=spec))
    brace = tokenizer.encode("{")[0]
    req.append_pending()
    host = Samples(torch.tensor([brace]))
    prev = LaunchedStep(None, [req], {"r": 0}, host, host, None)
    logits = torch.zeros(1, vocab.vocab_size)
    GrammarConstraint(vocab).apply(logits, [req], prev)
    ok = {t for t in range(vocab.vocab_size) if logits[0, t] == 0}
    assert ok and all(tokenizer.decode([t]).startswith('"') for t in ok)   # after "{": a key
    assert req.grammar_state.consumed == 1


def test_a_spec_with_generated_tokens_resumes_where_they_left_off(tokenizer, vocab):
    spec = GrammarSpec.regex("[0-9]{4}-done")
    done = tokenizer.encode("12")
    resumed = GrammarState.start(vocab, spec.continued(done))
    straight = GrammarState.start(vocab, spec)
    straight.catch_up(done)
    assert allowed(resumed, vocab.vocab_size) == allowed(straight, vocab.vocab_size)
    assert all(tokenizer.decode([t])[0].isdigit() for t in allowed(resumed, vocab.vocab_size))


@pytest.mark.parametrize("spec", [GrammarSpec.regex("[a-"), GrammarSpec.choice([]),
                                  GrammarSpec.json_schema({"type": "nope"})])
def test_a_bad_grammar_is_a_value_error(spec):
    with pytest.raises(ValueError):
        spec.check()
