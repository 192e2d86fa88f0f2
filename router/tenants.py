"""Tenants: API keys mapped to a prefix-cache salt and rate limits (issue 46).

    tenants:                       (configs/pd.yaml; router/app_sections.py TenantConfig)
      - name: team-a
        api_key_env: TEAM_A_KEY    # the environment variable holding the tenant's key
        requests_per_s: 5          # null: no limit
        tokens_per_s: 20000        # prompt + max_tokens of each request; null: no limit

A tenant's requests hash their prompts' KV blocks under the tenant's salt (its name, or
`cache_salt`; a request's own `cache_salt` field is added to it), so no other tenant's prompt
can hit their cached blocks in any engine's prefix cache, the KV pool or the KV tiers: nobody
learns through cached_tokens or TTFT what another tenant sent. Keys are compared in constant
time.

Limits are token buckets per router replica (a second's worth of burst), each replica given
its share, rate / router replicas: a request that finds a bucket short gets 429 with
Retry-After, the seconds until the bucket holds enough, and is charged nothing.

Lifecycle: `Tenants.from_config` once per router replica (keys read from the environment:
a missing one is a start-up error); `identify(authorization header)` per request -> Tenant
(or 401); `admit(tokens)` on that tenant once the prompt's length is known.
"""
from __future__ import annotations

import contextvars
import hmac
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.app_sections import TenantConfig
from router.errors import rate_limited, unauthorized

# The tenant of the request being served: set by the API's auth, read by the serving code in
# the same task (before any streaming starts).
CURRENT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("tenant", default=None)


@dataclass
class TokenBucket:
    """`rate` units a second, holding at most `capacity` (one second's worth, at least one
    request's need is let through when the bucket is full)."""

    rate: float
    capacity: float
    level: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def shortfall_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: it can now)."""
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass
class Tenant:
    name: str
    salt: str | None            # None: the prompts' hashes unsalted (one api_key_env key)
    requests: TokenBucket | None
    tokens: TokenBucket | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, tokens: int, now: float | None = None) -> None:
        """Charge one request of `tokens` tokens, or raise 429 and charge nothing."""
        now = time.monotonic() if now is None else now
        with self.lock:
            for bucket, amount, what in ((self.requests, 1, "requests"),
                                         (self.tokens, tokens, "tokens")):
                if bucket is not None and (wait := bucket.shortfall_s(amount, now)) > 0:
                    raise rate_limited(self.name, what, max(1, math.ceil(wait)))
            for bucket, amount in ((self.requests, 1), (self.tokens, tokens)):
                if bucket is not None:
                    bucket.take(amount)


def _bucket(rate: float | None, share: int) -> TokenBucket | None:
    if rate is None:
        return None
    per_replica = rate / share
    return TokenBucket(per_replica, max(1.0, per_replica))


class Tenants:
    """Who each API key is (module docstring)."""

    def __init__(self, tenants: Sequence[tuple[str, Tenant]]) -> None:
        self._by_key = [(f"Bearer {key}".encode(), tenant) for key, tenant in tenants]

    @classmethod
    def from_config(cls, configs: Sequence[TenantConfig], router_replicas: int) -> Tenants:
        pairs = []
        for c in configs:
            key = os.environ.get(c.api_key_env)
            if not key:
                raise ValueError(f"tenants: {c.name}'s api_key_env {c.api_key_env} is not set "
                                 "in the router's environment")
            pairs.append((key, Tenant(c.name, c.cache_salt or c.name,
                                      _bucket(c.requests_per_s, router_replicas),
                                      _bucket(c.tokens_per_s, router_replicas))))
        return cls(pairs)

    @classmethod
    def single(cls, key: str) -> Tenants:
        """`api_key_env`'s one key: one tenant, no salt, no limits."""
        return cls([(key, Tenant("default", None, None, None))])

    def identify(self, authorization: str) -> Tenant:
        """The tenant whose key the header carries (each key compared, in constant time);
        401 if none."""
        given = authorization.encode()
        found = None
        for expected, tenant in self._by_key:
            if hmac.compare_digest(given, expected):
                found = tenant
        if found is None:
            raise unauthorized()
        return found
