"""Logit bias and the presence, frequency and repetition penalties (pd_cluster/penalties.py)
against a plain reference: one row at a time, one token at a time, in Python. On random
logits (with a token still on the device, as under async scheduling), and on a tiny random
model, greedy, token for token: colocated (async scheduling on and off, chunked prefill,
penalized and plain requests in one batch) and disaggregated P -> D over NIXL and Ray and
through the KV pool, where P samples the first token and D the rest."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from tests.support.engine_clients import collect, prefilled_tokens
from pd_cluster import LLM, SamplingParams
from pd_cluster.penalties import Penalties
from pd_cluster.request import PENDING_TOKEN, Request
from router.protocol import ChatCompletionRequest, CompletionRequest, parse
from router.routing import Route
from tests.support.scripted_router import AUTH, error_of, make_client
from tests.support.tiny_models import make_tiny_model

NEW_TOKENS = 20
# Prompts that repeat themselves (the tiny model then repeats tokens of its own), so that
# every penalty has something to do.
PROMPTS = [[3, 4, 5, 6] * 5, [300, 12, 300, 12, 88, 300, 7, 7, 100, 200, 5, 6, 7, 8, 9, 10, 11,
                              12, 300, 12]]
CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "negative": dict(presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.6),
    "logit_bias": dict(logit_bias={7: 1.5, 300: 0.8, 12: -100.0, 0: 2.0}),
    "combined": dict(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3,
                     logit_bias={7: 1.0, 5: -1.0}),
}


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int],
                  params: SamplingParams) -> torch.Tensor:
    """vLLM's semantics, written out: bias, then repetition over every token seen, then
    frequency and presence over the output tokens."""
    row = logits.clone()
    for token, bias in params.logit_bias.items():
        row[token] += bias
    p = params.repetition_penalty
    for token in set(prompt) | set(output):
        row[token] = row[token] / p if row[token] > 0 else row[token] * p
    for token, count in Counter(output).items():
        row[token] -= params.frequency_penalty * count
        row[token] -= params.presence_penalty
    return row


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Each step a full forward of the whole sequence, the penalties, and argmax."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(reference_row(logits, prompt, output, params).argmax()))
    return output


def greedy(case: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **CASES[case])


@pytest.fixture(scope="module")
def tiny(tiny_model_root):
    return make_tiny_model("llama_gqa", tiny_model_root)


@pytest.fixture(scope="module")
def expected(tiny) -> dict[str, list[list[int]]]:
    """The reference's tokens per case (and with no penalty: "plain"), per prompt."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    cases = {name: greedy(name) for name in CASES}
    cases["plain"] = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return {name: [reference_greedy(model, p, params) for p in PROMPTS]
            for name, params in cases.items()}


@pytest.mark.slow
def test_every_case_changes_the_greedy_output(expected):
    """Otherwise the token-for-token tests below would prove nothing."""
    for name in CASES:
        assert expected[name] != expected["plain"], name


# --- pd_cluster/penalties.py on random logits ------------------------------------------------

def _request(i: int, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    req = Request(f"r{i}", prompt, params)
    req.output_token_ids = list(output)
    return req


@pytest.mark.parametrize("case", list(CASES))
def test_batched_penalties_equal_the_reference_row_by_row(case):
    gen = torch.Generator().manual_seed(7)
    vocab = 512
    logits = torch.randn(5, vocab, generator=gen) * 4
    params = [SamplingParams(**CASES[case]), SamplingParams(), SamplingParams(**CASES[case]),
              SamplingParams(**CASES["combined"]), SamplingParams(**CASES[case])]
    prompts = [PROMPTS[0], PROMPTS[1], [1], PROMPTS[1], [3, 3, 3]]
    outputs = [[5, 5, 8, 300, 5], [9, 9], [], [7, 7, 7, 12, 9], [0]]
    requests = [_request(i, p, o, sp) for i, (p, o, sp) in enumerate(zip(prompts, outputs,
                                                                          params))]
    got = logits.clone()
    Penalties(torch.device("cpu")).apply(got, requests)
    for i, r in enumerate(requests):
        want = reference_row(logits[i], r.prompt_token_ids, r.output_token_ids, r.params)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])      # no penalty: the row is untouched


def test_a_token_still_on_the_device_is_counted_from_the_previous_samples():
    params = SamplingParams(**CASES["combined"])
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    pending = [_request(0, [1, 2], [7, 9, PENDING_TOKEN], params),
               _request(1, [4], [PENDING_TOKEN], params)]
    # The previous step sampled three requests, these two among them, in another order.
    penalties = Penalties(torch.device("cpu"))
    penalties.remember([_request(9, [1], [], params), pending[1], pending[0]],
                       torch.tensor([40, 9, 33]))
    got = logits.clone()
    penalties.apply(got, pending)
    for i, (r, last) in enumerate(zip(pending, [33, 9])):
        known = r.output_token_ids[:-1] + [last]
        want = reference_row(logits[i], r.prompt_token_ids, known, params)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="still on the device"):
        Penalties(torch.device("cpu")).apply(logits.clone(), pending)


def test_prompts_stay_on_the_device_only_while_their_request_samples():
    penalties = Penalties(torch.device("cpu"))
    rep, plain = SamplingParams(repetition_penalty=1.5), SamplingParams()
    a, b = _request(0, [4, 4, 9], [], rep), _request(1, [5], [], rep)
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(5))
    for _ in range(2):     # the second step finds both prompts kept, and the same answer
        got = logits.clone()
        penalties.apply(got, [a, b])
        for i, r in enumerate([a, b]):
            want = reference_row(logits[i], r.prompt_token_ids, [], rep)
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert list(penalties._prompts) == [a, b]
    penalties.apply(logits[:1].clone(), [b])
    assert list(penalties._prompts) == [b]
    penalties.apply(logits[:1].clone(), [_request(2, [1], [], plain)])
    assert not penalties._prompts


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -3),
    ("frequency_penalty", True), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}), ("logit_bias", {5: float("nan")}),
])
def test_out_of_range_penalties_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(tiny):
    llm = LLM(tiny, block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, 512\)"):
        llm.generate([PROMPTS[0]], SamplingParams(logit_bias={512: 1.0}))


# --- the HTTP fields ---------------------------------------------------------------------------

def test_http_fields_map_to_the_sampling_params():
    body = {"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": -1.5,
            "frequency_penalty": 2, "repetition_penalty": 1.3,
            "logit_bias": {"7": 100, "0012": -100, "5": 0.5}}
    params = parse(ChatCompletionRequest, body).sampling_params(4, None, 0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (-1.5, 2.0, 1.3)
    assert params.logit_bias == {7: 100.0, 12: -100.0, 5: 0.5}
    nulls = {"prompt": "Hi", "presence_penalty": None, "frequency_penalty": None,
             "repetition_penalty": None, "logit_bias": None}
    assert not parse(CompletionRequest, nulls).sampling_params(4, None, 0).penalized


@pytest.fixture(scope="module")
def api(tokenizer):  # noqa: F811
    client, _ = make_client(tokenizer)
    with client:
        yield client


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, param", [
    ("presence_penalty", 2.01, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("frequency_penalty", "x", "frequency_penalty"), ("repetition_penalty", 0,
                                                      "repetition_penalty"),
    ("logit_bias", {"5": 100.5}, "logit_bias.5"), ("logit_bias", {"5": "x"}, "logit_bias.5"),
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", {"-1": 1}, "logit_bias"),
    ("logit_bias", {"49152": 1}, "logit_bias"), ("logit_bias", {str(2 ** 70): 1}, "logit_bias"),
    ("logit_bias", [1], "logit_bias"), ("logit_bias", {str(i): 1 for i in range(301)},
                                        "logit_bias"),
])
def test_http_penalties_out_of_range_are_400_naming_the_field(api, path, field, value, param):
    body = {"prompt": "Hi"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "Hi"}]}
    response = api.post(path, headers=AUTH, json={**body, "max_tokens": 2, field: value})
    error = error_of(response, 400)
    assert error["param"] == param and field in error["message"]


# --- the engine, token for token -------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_colocated_greedy_equals_the_reference(tiny, expected, async_scheduling):
    # Every case and the plain one in one batch; a 6-token budget chunks the prompts.
    llm = LLM(tiny, block_size=4, num_kv_blocks=80, max_num_batched_tokens=6,
              async_scheduling=async_scheduling)
    names = [*CASES, "plain"]
    params = [greedy(n) if n in CASES else SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True) for n in names]
    outs = llm.generate([p for _ in names for p in PROMPTS],
                        [sp for sp in params for _ in PROMPTS])
    got = [o.outputs[0].token_ids for o in outs]
    for k, name in enumerate(names):
        assert got[k * len(PROMPTS):(k + 1) * len(PROMPTS)] == expected[name], name


def test_sampled_rows_are_biased_and_penalized_too(tiny):
    """Temperature 1: a bias of 100 wins every draw; biases of 100 on a set of tokens and a
    repetition penalty of 2 (a used token's logit halves, to about 50) walk through the set
    without a repeat."""
    llm = LLM(tiny, block_size=4, num_kv_blocks=80)
    forced = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                            logit_bias={77: 100.0})
    allowed = list(range(400, 408))     # in neither prompt
    walk = SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True,
                          repetition_penalty=2.0, logit_bias={t: 100.0 for t in allowed})
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [forced, walk])
    assert outs[0].outputs[0].token_ids == [77] * 8
    assert sorted(outs[1].outputs[0].token_ids) == allowed


# Each mode and each transport once: the penalties ride in the request and P's first token in
# the hand-off, which are the same whichever transport moves the KV.
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mode, transport", [("disaggregated", "nixl"), ("pooled", "ray")])
def test_disaggregated_greedy_equals_the_reference(tiny, expected, mode, transport):
    ray = pytest.importorskip("ray")
    from router.app import start_client
    from router.app_config import AppConfig

    config = AppConfig.from_args({
        "mode": mode, "transport": transport,
        "engine": {"model": tiny, "block_size": 4, "num_kv_blocks": 160, "max_model_len": 512,
                   "max_num_seqs": 16, "async_scheduling": True},
        "limits": {"request_timeout_s": 60, "max_tokens": 64}})
    client = start_client(config, config.engine, {"prefill": {"num_cpus": 0},
                                                   "decode": {"num_cpus": 0}})
    try:
        async def run_all():
            await client.wait_ready(120)
            return await asyncio.gather(*[
                collect(client, f"{name}-{i}", prompt, greedy(name), Route(0, 0))
                for name in CASES for i, prompt in enumerate(PROMPTS)])
        outs = asyncio.run(run_all())
        got = [o.outputs[0].token_ids for o in outs]
        for k, name in enumerate(CASES):
            assert got[k * len(PROMPTS):(k + 1) * len(PROMPTS)] == expected[name], name
        # P computed every prompt and sampled the first tokens: D only decoded.
        assert prefilled_tokens(ray.get(client.decode[0].load.remote())) == 0
    finally:
        pool = getattr(client.handoff, "pool", None)
        for a in [*client.prefill, *client.decode, *([pool] if pool is not None else [])]:
            ray.kill(a)
