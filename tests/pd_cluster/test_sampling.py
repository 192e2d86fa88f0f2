"""Sampling: parameter validation, seeded reproducibility, and the filters' semantics."""
import pytest
import torch

from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("seed", 1.5), ("stop", [""]),
    ("stop_token_ids", [-1])])
def test_invalid_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


@pytest.fixture(scope="module")
def llm(tiny_model_root):
    return LLM(make_tiny_model("llama_gqa", tiny_model_root), block_size=4)


PROMPT = [5, 9, 13, 17, 21]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(llm.generate([PROMPT], seeded))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    batch = llm.generate([[3, 4], PROMPT + [6], PROMPT, [8] * 11], [others[0], others[1], seeded,
                                                                     others[2]])
    assert _tokens(batch)[2] == alone
    # Same seed, different position in another batch: still the same.
    batch2 = llm.generate([PROMPT, [1, 2, 3]], [seeded, others[0]])
    assert _tokens(batch2)[0] == alone


def test_different_seeds_give_different_samples(llm):
    runs = [_tokens(llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                                                          ignore_eos=True)))[0] for s in range(3)]
    assert len({tuple(r) for r in runs}) == 3


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    greedy = _tokens(llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True)))[0]
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=12,
                                  ignore_eos=True),
                   SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=12,
                                  ignore_eos=True)):
        assert _tokens(llm.generate([PROMPT], params))[0] == greedy


def test_filters_keep_only_allowed_tokens():
    from pd_cluster.request import Request
    from pd_cluster.sampler import Sampler

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    def kept(**kw):
        req = Request("r", [1], SamplingParams(**kw))
        return (Sampler._filter(probs.clone(), [req]) > 0).tolist()[0]
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]
    assert kept(top_p=0.9) == [True, True, True, False]
    assert kept(min_p=0.5) == [True, True, False, False]


def test_stop_token_ids_and_min_tokens(llm):
    greedy = _tokens(llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True)))[0]
    stop_at = greedy[5]
    first = greedy.index(stop_at)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # min_tokens bans the stop id until enough tokens are out.
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12 and stop_at not in out.outputs[0].token_ids
