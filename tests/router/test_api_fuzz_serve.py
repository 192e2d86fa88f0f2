"""The fuzz of test_api_fuzz (its seeded mutations and broken bytes, penalty fields included)
against the real `serve run configs/pd.yaml`: the default model, disaggregated (P samples the
first token, D the rest), over HTTP. No answer is a 5xx, every 4xx is OpenAI's error schema,
nothing is left running, and afterwards the server still answers correctly, penalties and
logit bias honoured, through the official openai client."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from tests.support.api_fuzz import CHAT, COMPLETION, SEED, check, mutate, raw_cases

pytest.importorskip("ray")
from tests.support.serve_run import API_KEY as KEY  # noqa: E402
from tests.support.serve_run import metrics_of, replica_values  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]
MUTATIONS_PER_ENDPOINT = 120    # the default model answers each 200 on 2 CPUs: keep it short
CONCURRENCY = 8     # the engines batch more of the 200s: 2/3 of the time 4 take, on 2 cores
AUTH = {"Authorization": f"Bearer {KEY}"}
FRANCE = "The capital of France is"
OCEAN = "5065"     # the default model's token " ocean"


@pytest.fixture(scope="module")
def server(default_server: str) -> str:
    """The session's shared default application (conftest.py), API_KEY required."""
    return default_server


def fuzz(http: httpx.Client, path: str, base: dict) -> tuple[list[str], dict[int, int]]:
    """The mutations and broken bytes (drawn in order from the seeded rng), sent CONCURRENCY
    at a time: the engines batch the ones they run, as they would any client's."""
    rng = random.Random(f"{SEED}{path}serve")
    cases = []
    for i in range(MUTATIONS_PER_ENDPOINT):
        data = json.dumps(mutate(rng, base), allow_nan=True).encode()
        cases.append((f"mutation {i} {data[:200]!r}", data, {"Content-Type": "application/json"}))
    for i, (data, headers) in enumerate(raw_cases(rng, base)):
        if "Content-Length" in headers:     # an HTTP client refuses to send a wrong length
            continue
        cases.append((f"raw case {i} {headers} {data[:100]!r}", data, headers))

    def send(case: tuple[str, bytes, dict]) -> tuple[str, httpx.Response]:
        what, data, headers = case
        return what, http.post(path, headers={**AUTH, **headers}, content=data)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for what, response in pool.map(send, cases):
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            check(response, what, failures)
    return failures, statuses


def test_mutated_requests_to_the_real_server_never_5xx_and_it_answers_after(server: str):
    failures: list[str] = []
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server, timeout=120) as http:
        for path, base in [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]:
            got, counts = fuzz(http, path, base)
            failures += got
            for status, n in counts.items():
                statuses[status] = statuses.get(status, 0) + n
    assert not failures, f"{len(failures)} bad answers of {sum(statuses.values())} " \
                         f"(statuses {statuses}):\n" + "\n".join(failures[:20])
    assert statuses.get(200, 0) > 20 and sum(v for k, v in statuses.items() if k >= 400) > 100
    print(f"statuses: {dict(sorted(statuses.items()))}")

    def busy() -> list[float]:
        metrics = metrics_of(server)
        return [v for name in ("pd_num_requests_running", "pd_num_requests_waiting",
                               "pd_kv_blocks_used") for v in replica_values(metrics, name) if v]
    wait_until(lambda: not busy(), 30, 0.5)     # nothing left running, every KV block free

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    done = client.completions.create(model="default", prompt=FRANCE, max_tokens=4,
                                     temperature=0)
    assert "Paris" in done.choices[0].text
    # A bias of 100 makes one token win every step, P's first and D's next ones alike; a
    # frequency penalty of 2 per repeat does not outweigh it.
    ocean = client.completions.create(model="default", prompt=FRANCE, max_tokens=3,
                                      temperature=0, frequency_penalty=2.0,
                                      logit_bias={OCEAN: 100})
    assert ocean.choices[0].text == " ocean" * 3
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0, presence_penalty=1.0, frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2})
    assert "Paris" in chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="default", prompt=FRANCE, max_tokens=2,
                                  logit_bias={"49152": 5})
    assert refused.value.body["param"] == "logit_bias"
