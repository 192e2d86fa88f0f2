"""Prometheus metrics of the router, vLLM-style, served at /metrics.

Latencies are measured in the router per engine request (what a client sees); per-replica
gauges and counters come from the replicas' load reports, read at scrape time, and tier
sizes, engine restarts and the membership version from the engine controller's membership, and
the planner's decisions from the controller's answer to each latency report. Names are
the ones the Grafana dashboard (helm/dashboards/pd-cluster.json) queries; replica metrics
carry `role` (a Role's value, "prefill" | "decode") and `replica` labels.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd_cluster.request import FinishReason
from pd_cluster.step_totals import STEP_FEATURES
from pd_cluster.planner import Action
from router.control.membership import Membership, ReplicaState
from router.control.planner_loop import MAX_SAMPLES, LatencySample, PlannerView
from router.kv_tier_metrics import KVTierCollector
from router.routing import ReplicaLoad
from router.transfer_metrics import TransferMetrics

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_REPLICA = ("role", "replica")
# pd_spec_decode_* counters: SpecStats fields (pd_cluster/spec_decode/decoder.py).
SPEC_COUNTERS = {
    "steps": "Engine steps that verified speculative drafts.",
    "proposed": "Draft tokens verified.",
    "accepted": "Draft tokens kept by verification.",
    "emitted": "Tokens emitted by speculating sequences (kept drafts + one each per step).",
    "seq_fallbacks": "Sequences that stopped speculating (acceptance EWMA too low).",
    "batch_fallbacks": "Steps decoded plainly because the batch exceeded max_batch_size.",
}


class _ReplicaCollector(Collector):
    """Exports the latest ReplicaLoad reports (set by RouterMetrics.set_loads)."""

    def __init__(self) -> None:
        self.loads: list[ReplicaLoad] = []

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=_REPLICA)

        running = gauge("pd_num_requests_running", "Requests in the engine's running batch.")
        waiting = gauge("pd_num_requests_waiting", "Requests waiting in the engine's queue.")
        usage = gauge("pd_kv_cache_usage_ratio", "Share of KV blocks held by requests.")
        used = gauge("pd_kv_blocks_used", "KV blocks held by requests.")
        free = gauge("pd_kv_blocks_free", "KV blocks free (cached prefixes included).")
        hit_rate = gauge("pd_prefix_cache_hit_rate", "Prompt tokens found in the prefix "
                         "cache / prompt tokens looked up, since start.")
        queries = CounterMetricFamily("pd_prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache.", labels=_REPLICA)
        hits = CounterMetricFamily("pd_prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache.", labels=_REPLICA)
        moved = CounterMetricFamily("pd_kv_transfer_bytes", "KV bytes sent (prefill) or "
                                    "received (decode).", labels=(*_REPLICA, "transport"))
        spent = CounterMetricFamily("pd_kv_transfer_seconds", "Time spent moving KV.",
                                    labels=(*_REPLICA, "transport"))
        steps = CounterMetricFamily("pd_engine_steps", "Engine steps, by kind (prefill, "
                                    "decode, mixed).", labels=(*_REPLICA, "kind"))
        step_s = CounterMetricFamily("pd_engine_step_seconds", "Time in engine steps, by "
                                     "kind.", labels=(*_REPLICA, "kind"))
        work = CounterMetricFamily("pd_engine_step_work", "Work in engine steps, by kind, in "
                                   "the profile's features: sum_tokens, sum_sq_tokens "
                                   "(prefill chunks), sum_ctx, batch (decodes).",
                                   labels=(*_REPLICA, "kind", "feature"))
        spec = {name: CounterMetricFamily(f"pd_spec_decode_{name}", doc, labels=_REPLICA)
                for name, doc in SPEC_COUNTERS.items()}
        spec_rate = gauge("pd_spec_decode_acceptance_rate", "Draft tokens kept / draft tokens "
                          "verified, since start (speculating replicas only).")
        for load in self.loads:
            labels = [str(load.role), str(load.replica_id)]
            if load.spec_decode:
                for name, family in spec.items():
                    family.add_metric(labels, load.spec_decode[name])
                spec_rate.add_metric(labels, load.spec_decode["acceptance_rate"])
            for kind, totals in load.steps.items():
                steps.add_metric([*labels, kind], totals["steps"])
                step_s.add_metric([*labels, kind], totals["seconds"])
                for feature in STEP_FEATURES:
                    work.add_metric([*labels, kind, feature], totals[feature])
            running.add_metric(labels, load.num_running)
            waiting.add_metric(labels, load.num_waiting)
            usage.add_metric(labels, load.kv_blocks_used / max(load.kv_blocks_total, 1))
            used.add_metric(labels, load.kv_blocks_used)
            free.add_metric(labels, load.kv_blocks_total - load.kv_blocks_used)
            hit_rate.add_metric(labels, load.prefix_hits / max(load.prefix_queries, 1))
            queries.add_metric(labels, load.prefix_queries)
            hits.add_metric(labels, load.prefix_hits)
            moved.add_metric([*labels, load.transport], load.kv_bytes_transferred)
            spent.add_metric([*labels, load.transport], load.kv_transfer_seconds)
        yield from (running, waiting, usage, used, free, hit_rate, queries, hits, moved, spent,
                    steps, step_s, work, *spec.values(), spec_rate)


class _KVPoolCollector(Collector):
    """Exports the KV pools' stats (pooled mode; set by RouterMetrics.set_kv_pools), one
    series per pool, labelled by its Ray node."""

    COUNTERS = {"bytes_in": "KV bytes written into the pool.",
                "bytes_out": "KV bytes read out of the pool.",
                "bytes_copied": "Of those, bytes engines on the pool's node copied through "
                                "its shared memory (no transport).",
                "hits": "Blocks found in the pool by lookups of a prompt's prefix.",
                "misses": "Blocks looked up and not found.",
                "evictions": "Blocks evicted (least recently used, never a held one)."}
    GAUGES = {"capacity_bytes": "The pool's block memory.",
              "cached": "Blocks cached by key.", "free": "Blocks free.",
              "pinned": "Blocks pinned by holds and reads (not evictable).",
              "holds": "Prompts whose blocks are kept for their decoder."}

    def __init__(self) -> None:
        self.pools: dict[str, dict] = {}

    def collect(self) -> Iterator[Metric]:
        for key, doc in self.COUNTERS.items():
            family = CounterMetricFamily(f"pd_kv_pool_{key}", doc, labels=("node",))
            for node, stats in self.pools.items():
                family.add_metric([node], stats[key])
            yield family
        for key, doc in self.GAUGES.items():
            family = GaugeMetricFamily(f"pd_kv_pool_{key}", doc, labels=("node",))
            for node, stats in self.pools.items():
                family.add_metric([node], stats[key])
            yield family


class _MembershipCollector(Collector):
    """Exports the engine controller's latest membership (set by RouterMetrics.set_membership):
    its version, each tier's replicas by state and target, each replica's restarts."""

    def __init__(self) -> None:
        self.membership: Membership | None = None

    def collect(self) -> Iterator[Metric]:
        m = self.membership
        if m is None:
            return
        version = GaugeMetricFamily("pd_membership_version", "Version of the engine "
                                    "controller's membership this router routes over.")
        version.add_metric([], m.version)
        replicas = GaugeMetricFamily("pd_tier_replicas", "Engine replicas of a role (its "
                                     "tier), by state.", labels=("role", "state"))
        target = GaugeMetricFamily("pd_tier_target_replicas", "Engine replicas of a role "
                                   "the controller keeps (its tier's size).", labels=("role",))
        restarts = CounterMetricFamily("pd_engine_restarts", "Engine actors started in a "
                                       "replica's slot after its first.", labels=_REPLICA)
        for role in m.roles():
            target.add_metric([str(role)], m.targets.get(role, 0))
            for state in ReplicaState:
                replicas.add_metric([str(role), state.value],
                                    sum(1 for r in m.of(role) if r.state is state))
        for r in m.members:
            restarts.add_metric([str(r.role), str(r.replica_id)], r.restarts)
        yield from (version, replicas, target, restarts)


class _PlannerCollector(Collector):
    """Exports the engine controller's planner decisions (set by RouterMetrics.set_planner,
    from the controller's answer to this router's latency report)."""

    def __init__(self) -> None:
        self.view: PlannerView | None = None

    def collect(self) -> Iterator[Metric]:
        if self.view is None or not self.view.enabled:
            return
        decisions = CounterMetricFamily("pd_planner_decisions", "P:D planner decisions, by "
                                        "action (hold included), since the controller "
                                        "started.", labels=("action",))
        for action in Action:
            decisions.add_metric([action.value], self.view.decisions.get(action.value, 0))
        yield decisions


class RouterMetrics:
    """Every metric of one router replica, in its own registry."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r, m = self.registry, ("model",)
        # The model label is fixed per router: these series are bound to it once (`labels()`
        # takes a lock and builds a key per call, and ITL is observed once per token).
        self.ttft = Histogram("pd_time_to_first_token_seconds", "Time to first token.", m,
                              registry=r, buckets=_TTFT_BUCKETS).labels(model)
        self.tpot = Histogram("pd_time_per_output_token_seconds", "Mean time per output "
                              "token after the first, per request.", m, registry=r,
                              buckets=_TOKEN_BUCKETS).labels(model)
        self.itl = Histogram("pd_inter_token_latency_seconds", "Time between two outputs "
                             "of a request.", m, registry=r, buckets=_TOKEN_BUCKETS).labels(model)
        self.e2e = Histogram("pd_e2e_request_latency_seconds", "Arrival to last token.", m,
                             registry=r, buckets=_E2E_BUCKETS).labels(model)
        self.finished = Counter("pd_request_success", "Engine requests finished, by "
                                "finish reason.", ("model", "finish_reason"), registry=r)
        self.prompt_tokens = Counter("pd_prompt_tokens", "Prompt tokens received.", m,
                                     registry=r).labels(model)
        self.generation_tokens = Counter("pd_generation_tokens", "Tokens generated.", m,
                                         registry=r).labels(model)
        self.decisions = Counter("pd_disagg_decisions", "Routing decisions: prefill on a "
                                 "prefill replica (remote) or on the decode replica (local).",
                                 ("decision",), registry=r)
        self.errors = Counter("pd_request_errors", "Requests answered with an error, by kind.",
                              ("kind",), registry=r)
        self.in_flight = Gauge("pd_router_engine_requests_in_flight", "Engine requests "
                               "admitted by this router and not finished.", registry=r)
        self.queued = Gauge("pd_router_requests_waiting", "Admitted engine requests beyond "
                            "the engines' running slots.", registry=r)
        self._replicas = _ReplicaCollector()
        r.register(self._replicas)
        self._membership = _MembershipCollector()
        r.register(self._membership)
        self._planner = _PlannerCollector()
        r.register(self._planner)
        self._kv_pools = _KVPoolCollector()
        r.register(self._kv_pools)
        # The KV tiers' counters from the engines' reports (router/kv_tier_metrics.py).
        self._kv_tiers = KVTierCollector()
        r.register(self._kv_tiers)
        # Each KV handover's time and bytes, failures by cause (router/transfer_metrics.py).
        self.transfers = TransferMetrics(r)
        # Finished requests for the engine controller's planner (router/control/planner_loop.py),
        # when it is on; sent and emptied every REPORT_EVERY_S.
        self.collect_samples = False
        self.samples: list[LatencySample] = []

    def set_loads(self, loads: Sequence[ReplicaLoad]) -> None:
        self._replicas.loads = list(loads)
        self._kv_tiers.set_loads(loads)

    def set_kv_pools(self, stats: dict[str, dict]) -> None:
        """The KV pools' stats by node (PoolHandoff.pool_stats); empty outside pooled mode."""
        self._kv_pools.pools = dict(stats)

    def set_membership(self, membership: Membership) -> None:
        self._membership.membership = membership

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, prompt_tokens: int = 0) -> RequestTimer:
        return RequestTimer(self, prompt_tokens)

    def take_samples(self) -> list[LatencySample]:
        """The finished requests' samples since the last call (for the planner)."""
        out, self.samples = self.samples, []
        return out

    def set_planner(self, view: PlannerView) -> None:
        self._planner.view = view


class RequestTimer:
    """Latency bookkeeping of one engine request, from arrival to its last output."""

    def __init__(self, metrics: RouterMetrics, prompt_tokens: int = 0) -> None:
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.arrived = time.time()
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def output(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finish(self, finish_reason: FinishReason, num_tokens: int) -> None:
        now, metrics = time.perf_counter(), self.metrics
        metrics.e2e.observe(now - self.start)
        metrics.finished.labels(metrics.model, finish_reason).inc()
        metrics.generation_tokens.inc(num_tokens)
        tpot = math.nan
        if self.first is not None and num_tokens > 1:
            tpot = (now - self.first) / (num_tokens - 1)
            metrics.tpot.observe(tpot)
        if metrics.collect_samples and self.first is not None \
                and len(metrics.samples) < MAX_SAMPLES:
            metrics.samples.append(LatencySample(self.arrived, self.first - self.start, tpot,
                                                 self.prompt_tokens, num_tokens))
