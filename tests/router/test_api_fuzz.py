"""Fuzz the HTTP API in-process (the real FastAPI app over a scripted engine, as in
test_router_api): a few hundred seeded mutations of valid request bodies on both endpoints —
wrong types for each field, extreme numbers (huge ints, negatives, NaN/Infinity as the JSON
parser accepts them, 1e308), deep nesting, long strings, lone surrogates, junk keys, nulls,
arrays for objects and back, penalties and logit biases at and past their limits (token ids
outside the vocabulary, keys that are not token ids), and broken bytes and headers. Every
answer must be < 500, every 4xx body OpenAI's error schema, and a correct request must still
succeed afterwards. test_api_fuzz_serve runs the same mutations against the real server."""
from __future__ import annotations

import json
import random

import pytest

from tests.support.scripted_router import AUTH, make_client
from tests.support.api_fuzz import CHAT, COMPLETION, SEED, check, mutate, raw_cases

MUTATIONS_PER_ENDPOINT = 200


@pytest.mark.slow
@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_mutated_requests_never_5xx_and_errors_keep_the_schema(tokenizer, path, base):  # noqa: F811
    client, engine = make_client(tokenizer)
    rng = random.Random(f"{SEED}{path}")
    failures: list[str] = []
    statuses: dict[int, int] = {}
    with client:
        for i in range(MUTATIONS_PER_ENDPOINT):
            body = mutate(rng, base)
            # allow_nan: NaN/Infinity go out as the literals Python's parser accepts;
            # ensure_ascii: lone surrogates go out as \\ud800 escapes, valid JSON.
            data = json.dumps(body, allow_nan=True).encode()
            response = client.post(path, headers={**AUTH, "Content-Type": "application/json"},
                                   content=data)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            check(response, f"mutation {i} {data[:200]!r}", failures)
        for i, (data, headers) in enumerate(raw_cases(rng, base)):
            response = client.post(path, headers={**AUTH, **headers}, content=data)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            check(response, f"raw case {i} {headers} {data[:100]!r}", failures)
        assert not engine.active          # nothing left running on the engine
        ok = client.post(path, headers=AUTH, json=base)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 2
    assert not failures, f"{len(failures)} bad answers of {sum(statuses.values())} " \
                         f"(statuses {statuses}):\n" + "\n".join(failures[:20])
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k >= 400) > 100
