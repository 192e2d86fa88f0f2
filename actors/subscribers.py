"""Subscriber leases: an engine actor's view of which router replicas are still there.

A router replica is a subscriber, named by its `OutputStreams.sub`. It renews a lease on
every engine it uses (`keepalive(sub)`, every SUBSCRIBER_RENEW_EVERY_S) and names itself on
every request it starts. A router whose process dies stops renewing; once SUBSCRIBER_LEASE_S
has passed without a renewal, the engine ends everything that router left here — its streams
and reservations (decode side), its prefills (prefill side) — so their KV blocks are freed
even when nobody is left to abort them. A lease of a few seconds, renewed each second, rides
out a busy router's late renewals without holding a dead router's blocks for long. (D's
reservation of a prompt's blocks has a lease of its own, renewed while P prefills:
RESERVATION_LEASE_S in actors/engine_actor.py.)

Lifecycle of a subscriber, as one engine sees it:
    first seen      keepalive(sub), or a request naming it → leased
    renewed         each keepalive (and each request) pushes the expiry back
    expired         no renewal for SUBSCRIBER_LEASE_S → `on_expire(sub, request ids)` ends
                    what it tracked here; a later keepalive starts it afresh
A request is tracked from `track` until `done` (it finished or moved on: a reservation that
D starts decoding is then the subscriber's stream, which the outbox tracks).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

SUBSCRIBER_LEASE_S = 10.0
SUBSCRIBER_RENEW_EVERY_S = 1.0     # how often a router replica renews (router side)


class Subscribers:
    def __init__(self, on_expire: Callable[[str, list[str]], None],
                 lease_s: float = SUBSCRIBER_LEASE_S) -> None:
        self.on_expire, self.lease_s = on_expire, lease_s
        self._seen: dict[str, float] = {}          # subscriber → last renewal (monotonic)
        self._requests: dict[str, set[str]] = {}   # subscriber → its tracked request ids
        self._owner: dict[str, str] = {}           # request id → subscriber
        self._watch: asyncio.Task | None = None

    def renew(self, sub: str) -> None:
        self._seen[sub] = time.monotonic()
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._expire_loop())

    def track(self, sub: str | None, request_id: str) -> None:
        """`request_id` belongs to `sub` until `done` (None: a caller without a lease)."""
        if sub is None:
            return
        self.renew(sub)
        self._requests.setdefault(sub, set()).add(request_id)
        self._owner[request_id] = sub

    def done(self, request_id: str) -> None:
        sub = self._owner.pop(request_id, None)
        if sub is not None:
            self._requests.get(sub, set()).discard(request_id)

    def alive(self) -> list[str]:
        return sorted(self._seen)

    def expire_now(self) -> None:
        """End every subscriber whose lease has passed (the watch loop calls this)."""
        now = time.monotonic()
        for sub, seen in list(self._seen.items()):
            if now - seen <= self.lease_s:
                continue
            del self._seen[sub]
            ids = sorted(self._requests.pop(sub, set()))
            for rid in ids:
                self._owner.pop(rid, None)
            logger.warning("router %s has not renewed its lease for %.0f s: ending its %d "
                           "request(s) here", sub, now - seen, len(ids))
            try:
                self.on_expire(sub, ids)
            except Exception:  # noqa: BLE001 - one subscriber's cleanup must not stop the rest
                logger.exception("ending the requests of %s failed", sub)

    async def _expire_loop(self) -> None:
        while self._seen:
            await asyncio.sleep(self.lease_s / 4)
            self.expire_now()
