"""Speculative decoding with temperature 1 keeps the target's distribution: the first two
tokens of many seeded requests (the second is the first speculated position: verified by
rejection sampling) follow the model's exact joint distribution, by a chi-square test at
alpha = 0.001; and a seeded request's output is reproducible."""
from __future__ import annotations

import math

import pytest
import torch

from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model

VOCAB = 16          # small: every token's probability is estimated, the test is quick
# The time is per request; the joint's likely cells still expect well over 5 each (the
# unlikely ones are pooled: chi_square_p_value).
NUM_SAMPLES = 1000
ALPHA = 1e-3
# Every token occurs in the prompt, so unigram lookup proposes after any first token.
PROMPT = list(range(VOCAB)) + [3, 5, 7, 9, 11]
ENGINE = dict(block_size=4, max_num_seqs=512, max_num_batched_tokens=4096)


def small_vocab_model(family: str, root: str) -> str:
    # A larger initial weight spread gives peaked distributions: drafts get both kept and
    # rejected often.
    return make_tiny_model(family, root, vocab_size=VOCAB, initializer_range=0.5)


def next_token_probs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), VOCAB] the model's next-token distribution after each prompt."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=VOCAB))
    probs = torch.zeros(len(prompts), VOCAB, dtype=torch.float64)
    for i, out in enumerate(outs):
        for token, lp in out.outputs[0].logprobs[0].items():
            probs[i, token] = math.exp(lp)
    return probs / probs.sum(-1, keepdim=True)


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of counts against expected counts; cells expecting fewer than 5 are
    pooled into one (the usual validity condition)."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow           # NUM_SAMPLES requests each
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_first_speculated_position_follows_the_target_distribution(method, tiny_model_root):
    model_dir = small_vocab_model("llama_gqa", tiny_model_root)
    plain = LLM(model_dir, **ENGINE)
    first = next_token_probs(plain, [PROMPT])[0]                           # P(o0)
    second = next_token_probs(plain, [PROMPT + [a] for a in range(VOCAB)])   # P(o1 | o0)
    joint = (first[:, None] * second).flatten()

    spec = ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
            if method == "ngram" else
            {"method": "draft_model", "draft_model": small_vocab_model("qwen3_qknorm",
                                                                       tiny_model_root)})
    llm = LLM(model_dir, **ENGINE, speculative={**spec, "num_speculative_tokens": 2,
                                                "max_batch_size": 512,
                                                "min_acceptance_rate": 0.0})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True)
              for i in range(NUM_SAMPLES)]
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    for out in outs:
        o0, o1 = out.outputs[0].token_ids[:2]
        counts[o0 * VOCAB + o1] += 1
    stats = llm.engine.spec.stats
    # Nearly every request speculated at its second token, and drafts were both kept and
    # rejected many times.
    assert stats.steps > 0 and sum(o.spec_proposed_tokens > 0 for o in outs) > 0.9 * NUM_SAMPLES
    assert 100 < stats.accepted < stats.proposed - 100
    p = chi_square_p_value(counts, joint * NUM_SAMPLES)
    print(f"{method}: chi-square p = {p:.3f}, {stats}")
    assert p > ALPHA, f"chi-square p = {p:.2e}: speculation changed the distribution"


def test_seeded_speculative_sampling_is_reproducible(tiny_model_root):
    model_dir = small_vocab_model("llama_gqa", tiny_model_root)
    spec = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(6)]
    runs = []
    for batch in (6, 2):        # a request's tokens do not depend on its batch
        llm = LLM(model_dir, block_size=4, max_num_seqs=batch, speculative=spec)
        runs.append([o.outputs[0].token_ids for o in llm.generate([PROMPT] * 6, params)])
        assert llm.engine.spec.stats.accepted > 0
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1
