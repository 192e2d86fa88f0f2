"""The real `serve run configs/pd.yaml` (a subprocess on a local Ray, loopback only), driven
with the official openai client: completions and chat, streamed and not, stop strings, seeds,
n > 1, logprobs, usage with cached tokens, the factual answer; 4xx OpenAI errors that leave
the server serving; 64 concurrent streams of which a quarter disconnect, after which no
request runs and every KV block is free; /metrics parsed by prometheus_client.

The server is the session's shared default application (`default_server` in conftest.py).
"""
from __future__ import annotations

import asyncio

import httpx2 as httpx
import openai
import pytest

pytest.importorskip("ray")
from tests.support.serve_run import API_KEY as KEY  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402
from tests.support.serve_run import metrics_of, replica_values

# The server takes 20-30 s to start on 2 cores: out of the quick run (-m "not slow").
pytestmark = [pytest.mark.serve, pytest.mark.slow]
FRANCE = "The capital of France is"
LEAVER_TOKENS = 4000            # at >= 20 ms per decode step: over 80 s to finish naturally
IDLE_WITHIN_S = 30


@pytest.fixture(scope="module")
def server(default_server: str) -> str:
    """The session's shared default application (conftest.py), API_KEY required."""
    return default_server


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


def test_capital_of_france_with_usage(client: openai.OpenAI, tokenizer):
    done = client.completions.create(model="default", prompt=FRANCE, max_tokens=8,
                                     temperature=0)
    assert "Paris" in done.choices[0].text
    assert done.usage.prompt_tokens == len(tokenizer.encode(FRANCE))
    assert done.usage.completion_tokens == len(tokenizer.encode(done.choices[0].text)) <= 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens


def test_chat_streamed_equals_whole_and_cached_tokens_count(client: openai.OpenAI):
    messages = [{"role": "system", "content": "You are a terse geography assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in whole.choices[0].message.content
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The second request found the first's prompt blocks in the prefix cache.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < whole.usage.prompt_tokens and cached % 16 == 0


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI):
    done = client.completions.create(model="default", prompt=FRANCE, max_tokens=8,
                                     temperature=0, stop=["."])
    assert done.choices[0].text.strip() == "Paris"
    assert done.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_n_gives_n_choices(client: openai.OpenAI):
    def sample() -> list[str]:
        done = client.completions.create(model="default", prompt="Once upon a time",
                                         max_tokens=10, temperature=1.0, top_p=0.95,
                                         seed=1234, n=3)
        assert sorted(c.index for c in done.choices) == [0, 1, 2]
        assert 3 <= done.usage.completion_tokens <= 30
        return [c.text for c in sorted(done.choices, key=lambda c: c.index)]

    first = sample()
    assert sample() == first
    assert len(set(first)) > 1       # each choice has its own seed (seed + index)


def test_logprobs_in_both_shapes(client: openai.OpenAI):
    done = client.completions.create(model="default", prompt=FRANCE, max_tokens=3,
                                     temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == done.usage.completion_tokens
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": FRANCE}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert content[0].logprob <= 0 and len(content[0].top_logprobs) == 3


def test_bad_requests_get_4xx_openai_errors_and_serving_goes_on(server: str,
                                                                client: openai.OpenAI):
    raw = httpx.post(f"{server}/v1/completions", content=b'{"prompt": ',
                     headers={"Authorization": f"Bearer {KEY}",
                              "Content-Type": "application/json"}, timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    cases = [(openai.NotFoundError, dict(model="gpt-5")),
             (openai.BadRequestError, dict(temperature=-1.0)),
             (openai.BadRequestError, dict(max_tokens=5000)),              # limit: 4096
             (openai.BadRequestError, dict(prompt="hello " * 9000))]       # context: 8192
    for error, override in cases:
        with pytest.raises(error) as info:
            client.completions.create(**{"model": "default", "prompt": FRANCE, **override})
        assert info.value.body["message"] and info.value.status_code < 500
    wrong_key = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    assert [m.id for m in client.models.list().data] == ["default"]
    assert client.completions.create(model="default", prompt=FRANCE, max_tokens=2).choices
    errors = {s.labels["kind"] for s in metrics_of(server)["pd_request_errors"]}
    assert {"invalid_json", "model_not_found", "invalid_api_key"} <= errors


async def stream_one(aclient: openai.AsyncOpenAI, i: int, leave: bool) -> tuple[str, bool]:
    """One streaming client; if `leave`, it hangs up after two chunks, else it reads the
    stream to its end ([DONE]). Returns its finish reason ("" if none) and whether it hung up
    on an unfinished stream."""
    # A leaver asks for far more tokens than could be generated in the test's time, so its
    # KV can only be free afterwards if hanging up aborted it.
    stream = await aclient.completions.create(
        model="default", prompt=f"Story number {i}: once upon a time", temperature=0,
        max_tokens=LEAVER_TOKENS if leave else 12, stream=True,
        extra_body={"ignore_eos": leave})
    seen, reason = 0, ""
    async for chunk in stream:
        seen += 1
        reason = chunk.choices[0].finish_reason or reason
        if leave and seen == 2 and not reason:
            await stream.close()
            return "", True
    return reason, False


def test_64_streams_with_a_quarter_disconnecting_leave_nothing_behind(server: str):
    before = sum(s.value for s in metrics_of(server)["pd_request_errors"]
                 if s.labels.get("kind") == "client_disconnected")

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0,
                                     timeout=300)
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(
                *[stream_one(aclient, i, leave=i % 4 == 0) for i in range(64)]), 400)

    results = asyncio.run(run_all())
    stayed = [reason for i, (reason, _) in enumerate(results) if i % 4]
    assert all(reason in ("stop", "length") for reason in stayed), stayed
    hung_up = sum(left for _, left in results)
    assert hung_up >= 12
    def idle() -> bool:
        nonlocal metrics, busy
        metrics = metrics_of(server)
        busy = (replica_values(metrics, "pd_num_requests_running")
                + replica_values(metrics, "pd_num_requests_waiting")
                + replica_values(metrics, "pd_kv_blocks_used"))
        return not any(busy)
    metrics, busy = {}, []
    try:
        wait_until(idle, IDLE_WITHIN_S, 0.5)
    except TimeoutError:
        pass            # the assertion says what is still busy
    assert not any(busy), busy
    usage = replica_values(metrics, "pd_kv_cache_usage_ratio")
    assert usage and set(usage) == {0.0}
    gone = sum(s.value for s in metrics["pd_request_errors"]
               if s.labels.get("kind") == "client_disconnected")
    assert gone - before == hung_up


def test_metrics_parse_and_expose_the_dashboard_names(server: str):
    metrics = metrics_of(server)
    for name in ["pd_time_to_first_token_seconds", "pd_time_per_output_token_seconds",
                 "pd_inter_token_latency_seconds", "pd_e2e_request_latency_seconds",
                 "pd_num_requests_running", "pd_num_requests_waiting",
                 "pd_kv_cache_usage_ratio", "pd_kv_blocks_used", "pd_kv_blocks_free",
                 "pd_prefix_cache_hit_rate", "pd_prefix_cache_hits", "pd_kv_transfer_bytes",
                 "pd_kv_transfer_seconds", "pd_disagg_decisions", "pd_request_errors",
                 "pd_request_success", "pd_router_requests_waiting", "pd_engine_steps",
                 "pd_engine_step_seconds", "pd_engine_step_work"]:
        assert name in metrics, name
    ttft_count = [s for s in metrics["pd_time_to_first_token_seconds"]
                  if s.name.endswith("_count")]
    assert ttft_count[0].value > 0
    roles = {s.labels["role"] for s in metrics["pd_num_requests_running"]}
    assert roles <= {"prefill", "decode"} and "decode" in roles
    assert max(replica_values(metrics, "pd_prefix_cache_hit_rate")) > 0
    # Steps by kind, with the work in them in the profile's features (profile-serving's input).
    kinds = {s.labels["kind"] for s in metrics["pd_engine_steps"]}
    assert kinds == {"prefill", "decode", "mixed"}
    served = sum(s.value for s in metrics["pd_engine_steps"] if s.name.endswith("_total"))
    assert served > 0
    features = {s.labels["feature"] for s in metrics["pd_engine_step_work"]}
    assert features == {"sum_tokens", "sum_sq_tokens", "sum_ctx", "batch"}


def test_every_answer_names_its_router_replica(server: str):
    """`x-pd-router` on every answer: models, health, metrics, completions, an unknown route."""
    auth = {"Authorization": f"Bearer {KEY}"}
    answers = [httpx.get(f"{server}/v1/models", headers=auth, timeout=30),
               httpx.get(f"{server}/health", timeout=30),
               httpx.get(f"{server}/metrics", timeout=30),
               httpx.post(f"{server}/v1/completions", headers=auth, timeout=60,
                          json={"model": "default", "prompt": FRANCE, "max_tokens": 1}),
               httpx.get(f"{server}/v1/nowhere", timeout=30)]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 404]
    names = {a.headers.get("x-pd-router") for a in answers}
    assert len(names) == 1 and None not in names and "" not in names, names
