"""Per-transfer KV metrics of the router (issue 48): how long each prompt's KV handover took
and how many bytes it moved, and the handovers that failed or expired, by cause. Labelled by
transport and by the P -> D pair, which stays bounded: replicas past MAX_PAIR_REPLICAS on
either side share the pair "other" (a planner may number replicas far up over a long run).

The router observes them where it learns of them, from P's answer (PrefillResult.kv_bytes and
transfer_s: the handover's start to the KV in place, as P sees it) and from D's or P's error,
once per request attempt: nothing per token. The per-replica totals (pd_kv_transfer_bytes /
_seconds, from the replicas' load reports) stay in router/metrics.py; these are their
distributions, which the Grafana dashboard's transfer panels chart.
Lifecycle: made with the router's RouterMetrics (its registry); lives as long as it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

MAX_PAIR_REPLICAS = 16
# 1 ms .. 10 s: a layer-wise push lands within a few ms of the prefill's end on GPUs, a
# CPU / host-memory or cross-node transfer of a long prompt takes up to seconds.
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# 64 KiB .. 16 GiB in steps of 4x: a short prompt of a small model to a long one of a 70B.
_BYTES = tuple(float(64 * 1024 * 4 ** k) for k in range(10))
CAUSES = ("expired", "timeout", "no_room", "aborted", "peer_died", "error")
_LABELS = ("transport", "pair")


def pair(p_id: int | None, d_id: int | None) -> str:
    """The bounded label of a P -> D pair."""
    if p_id is None or d_id is None or max(p_id, d_id) >= MAX_PAIR_REPLICAS:
        return "other"
    return f"p{p_id}-d{d_id}"


def cause_of(error: BaseException) -> str:
    """One of CAUSES for a failed handover, from the error the actor raised (its type and
    message are all that crosses Ray)."""
    from ray.exceptions import RayActorError

    if isinstance(error, RayActorError):
        return "peer_died"
    text = f"{type(error).__name__} {error}".lower()
    for cause, words in (("expired", ("expired", "lease")), ("timeout", ("timeout", "timed out")),
                         ("no_room", ("no room",)), ("aborted", ("abort",))):
        if any(w in text for w in words):
            return cause
    return "error"


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram(
            "pd_kv_transfer_duration_seconds", "One prompt's KV handover, from its start (D's "
            "blocks known) to the KV in place, as P sees it.", _LABELS, registry=registry,
            buckets=_SECONDS)
        self.bytes = Histogram(
            "pd_kv_transfer_size_bytes", "Bytes of one prompt's KV handover.", _LABELS,
            registry=registry, buckets=_BYTES)
        self.failed = Counter(
            "pd_kv_transfer_failures", "KV handovers that failed, by cause (expired: a lease "
            "ran out; timeout; no_room: D could not reserve; aborted; peer_died; error).",
            (*_LABELS, "cause"), registry=registry)

    def observe(self, transport: str, p_id: int | None, d_id: int | None, nbytes: int,
                seconds: float) -> None:
        labels = (transport or "unknown", pair(p_id, d_id))
        self.seconds.labels(*labels).observe(seconds)
        self.bytes.labels(*labels).observe(nbytes)

    def fail(self, transport: str, p_id: int | None, d_id: int | None,
             error: BaseException) -> None:
        self.failed.labels(transport or "unknown", pair(p_id, d_id), cause_of(error)).inc()
