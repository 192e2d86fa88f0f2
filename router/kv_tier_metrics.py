"""Prometheus metrics of the KV cache hierarchy (docs/kv_tiers.md), from the engines' load
reports (ReplicaLoad.kv_tiers, filled by actors/kv_tiers.py when kv_tiers is on).

Per engine replica (labels role, replica), what it loaded instead of computing:
    pd_kv_tier_hit_blocks{tier}        blocks loaded from the host / disk tier
    pd_kv_tier_loads, pd_kv_tier_load_seconds   loads and their time (mean load latency =
                                       the ratio of their rates)
    pd_kv_tier_recomputed_blocks       blocks a tier held that the cost rule recomputed
    pd_kv_tier_offloaded_blocks        blocks it wrote down to its node's host tier
Per node (label node; every engine of a node reports the node's one host tier, the latest
report wins), by tier (host | disk):
    pd_kv_tier_bytes_in / _bytes_out   bytes written into / read out of the tier
    pd_kv_tier_evictions               blocks evicted (host: down to disk, if any)
    pd_kv_tier_used_bytes, pd_kv_tier_capacity_bytes
    pd_kv_tier_corrupt_blocks          disk blocks whose checksum or size failed (recomputed)
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.messages import ReplicaLoad

_REPLICA = ("role", "replica")
# (metric, host tier stats key, disk tier stats key) of the per-node, per-tier series.
_NODE_COUNTERS = (("bytes_in", "bytes_in", "disk_bytes_written"),
                  ("bytes_out", "bytes_out", "disk_bytes_read"),
                  ("evictions", "evictions", "disk_evictions"))
_DOCS = {"bytes_in": "KV bytes written into the tier.",
         "bytes_out": "KV bytes read out of the tier.",
         "evictions": "Blocks the tier evicted (least recently used)."}


class KVTierCollector(Collector):
    """See the module docstring; `loads` is set with the router's other load reports."""

    def __init__(self) -> None:
        self.loads: list[ReplicaLoad] = []

    def set_loads(self, loads: Sequence[ReplicaLoad]) -> None:
        self.loads = [ld for ld in loads if getattr(ld, "kv_tiers", None)]

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily("pd_kv_tier_hit_blocks", "KV blocks loaded from a tier "
                                   "instead of computed.", labels=(*_REPLICA, "tier"))
        loads = CounterMetricFamily("pd_kv_tier_loads", "Prefix loads from the KV tiers.",
                                    labels=_REPLICA)
        load_s = CounterMetricFamily("pd_kv_tier_load_seconds", "Time spent loading "
                                     "prefixes from the KV tiers.", labels=_REPLICA)
        recomputed = CounterMetricFamily("pd_kv_tier_recomputed_blocks", "Blocks a tier held "
                                         "that the cost rule chose to recompute.",
                                         labels=_REPLICA)
        offloaded = CounterMetricFamily("pd_kv_tier_offloaded_blocks", "Blocks written down "
                                        "to the node's host tier.", labels=_REPLICA)
        nodes: dict[str, dict] = {}
        for load in self.loads:
            t, labels = load.kv_tiers, [str(load.role), str(load.replica_id)]
            hits.add_metric([*labels, "host"], t.get("host_hits", 0))
            hits.add_metric([*labels, "disk"], t.get("disk_hits", 0))
            loads.add_metric(labels, t.get("loads", 0))
            load_s.add_metric(labels, t.get("load_s", 0.0))
            recomputed.add_metric(labels, t.get("recomputed", 0))
            offloaded.add_metric(labels, t.get("offloaded", 0))
            host = t.get("host_tier") or {}
            if "node" in host:
                nodes[host["node"]] = host
        yield from (hits, loads, load_s, recomputed, offloaded)
        yield from self._node_series(nodes)

    @staticmethod
    def _node_series(nodes: dict[str, dict]) -> Iterator[Metric]:
        labels = ("node", "tier")
        for name, host_key, disk_key in _NODE_COUNTERS:
            family = CounterMetricFamily(f"pd_kv_tier_{name}", _DOCS[name], labels=labels)
            for node, st in nodes.items():
                family.add_metric([node, "host"], st.get(host_key, 0))
                if disk_key in st:
                    family.add_metric([node, "disk"], st[disk_key])
            yield family
        used = GaugeMetricFamily("pd_kv_tier_used_bytes", "Bytes of blocks the tier holds.",
                                 labels=labels)
        capacity = GaugeMetricFamily("pd_kv_tier_capacity_bytes", "The tier's byte budget.",
                                     labels=labels)
        corrupt = CounterMetricFamily("pd_kv_tier_corrupt_blocks", "Disk blocks whose "
                                      "checksum or size failed (recomputed, never used).",
                                      labels=("node",))
        for node, st in nodes.items():
            block = st.get("block_bytes", 0)
            used.add_metric([node, "host"], st.get("cached", 0) * block)
            capacity.add_metric([node, "host"], st.get("capacity_bytes", 0))
            if "disk_used_bytes" in st:
                used.add_metric([node, "disk"], st["disk_used_bytes"])
                capacity.add_metric([node, "disk"], st["disk_capacity_bytes"])
                corrupt.add_metric([node], st.get("disk_corrupt", 0))
        yield from (used, capacity, corrupt)
