"""Tenants (router/tenants.py) through the router's HTTP layer in-process: each key is its
tenant, with its own cache salt (different tenants' prompts never hash alike) and its own rate
limits (429 with Retry-After, charging nothing); the token bucket's refill."""
from __future__ import annotations

import pytest

from router.tenants import Tenant, TokenBucket
from router.errors import APIError
from tests.support.scripted_router import error_of, make_client

KEYS = {"A_KEY": "sk-tenant-a", "B_KEY": "sk-tenant-b"}


@pytest.fixture
def api(tokenizer, monkeypatch):
    for name, key in KEYS.items():
        monkeypatch.setenv(name, key)
    client, engine = make_client(tokenizer, tenants=[
        {"name": "a", "api_key_env": "A_KEY", "requests_per_s": 1},
        {"name": "b", "api_key_env": "B_KEY", "tokens_per_s": 40}])
    with client:
        yield client, engine


def post(client, key: str, **body):
    return client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "default", "prompt": "Hi", "max_tokens": 4, **body})


def test_each_tenant_has_its_own_limits_and_a_refusal_says_when_to_retry(api):
    client, _ = api
    a, b = KEYS["A_KEY"], KEYS["B_KEY"]
    assert error_of(post(client, "sk-nobody"), 401)["code"] == "invalid_api_key"
    assert post(client, a).status_code == 200
    refused = post(client, a)
    error = error_of(refused, 429)
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "'a'" in error["message"] and refused.headers["retry-after"] == "1"
    # b's limit is in tokens (prompt + max_tokens): a's exhausted bucket is not b's.
    assert post(client, b, max_tokens=30).status_code == 200
    refused = post(client, b, max_tokens=30)
    assert error_of(refused, 429)["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1


def test_tenants_salt_their_prompts_apart(api):
    client, engine = api
    a, b = KEYS["A_KEY"], KEYS["B_KEY"]
    assert post(client, b).status_code == 200
    assert post(client, b).status_code == 200
    assert post(client, b, cache_salt="x").status_code == 200
    assert post(client, a, cache_salt="x").status_code == 200
    salts = [p.cache_salt for p in engine.params[-4:]]
    assert salts[0] == salts[1]                         # a tenant shares with itself
    assert len(set(salts[1:])) == 3 and None not in salts


def test_a_bucket_refills_at_its_rate_and_a_refusal_charges_nothing():
    tenant = Tenant("t", "t", TokenBucket(2.0, 2.0, stamp=0.0), TokenBucket(100.0, 100.0,
                                                                           stamp=0.0))
    tenant.admit(10, now=0.0)
    tenant.admit(10, now=0.0)
    with pytest.raises(APIError) as refused:
        tenant.admit(10, now=0.1)                      # requests: 0.2 of 1 refilled
    assert refused.value.headers == {"Retry-After": "1"}
    tenant.admit(10, now=0.5)                          # 1 request back after 0.5 s
    assert tenant.tokens.level == pytest.approx(90)    # refilled to its capacity, less 10
    tenant.admit(500, now=1.5)         # more than a second's worth goes through a full bucket
    with pytest.raises(APIError):
        tenant.admit(1, now=2.0)       # ...and is paid back before anything else
