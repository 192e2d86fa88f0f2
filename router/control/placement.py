"""Why Ray has not placed an engine actor: what it asks for against what the cluster's nodes
offer, and whether an autoscaler is adding nodes (router/control/fleet.py reports it in /health and
the log while a replica stays PENDING)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

# Ray's states of an actor not yet created. PENDING_CREATION lasts until the actor's
# constructor returns: the actor is placed once Ray has given it a worker process.
RAY_PENDING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")
MOST_NODES_NAMED = 8       # a message of /health and the log, not a cluster listing


def unplaced_reason(resources: Mapping[str, Any]) -> str:
    """Why Ray has not placed an actor asking for `resources` (its actor options)."""
    need = _demand(resources)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
    if not fits:
        largest = max((n["Resources"] for n in nodes), default={},
                      key=lambda r: tuple(r.get(k, 0) for k in need))
        why = (f"no node of the cluster has that much (the largest offers "
               f"{_fmt({k: largest.get(k, 0) for k in need})})")
    else:
        why = f"the nodes that could take it are full (free now: {_free_on(fits, need)})"
    ask = f"asks for {_fmt(need)}: "
    if _autoscaler_launching():
        return ask + why + "; the autoscaler is adding nodes: it waits for them"
    return ask + why + ("; lower the replica's resources or add a node (or wait for an "
                        "autoscaler to add one)")


def _free_on(nodes: list[dict], need: Mapping[str, float]) -> str:
    """What each of `nodes` has free of what the actor asks for: a sum over nodes would read
    as room (a CPU free on one node, the role's resource on another)."""
    try:
        from ray._private.state import available_resources_per_node
        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - no answer: say nothing of what is free
        free = {}
    named = [f"node {n['NodeManagerAddress']} {n['NodeID'][:8]} "
             f"{_fmt({k: free.get(n['NodeID'], {}).get(k, 0) for k in need})}"
             for n in nodes[:MOST_NODES_NAMED]]
    more = len(nodes) - MOST_NODES_NAMED
    return "; ".join(named) + (f"; and {more} more nodes" if more > 0 else "")


def _demand(options: Mapping[str, Any]) -> dict[str, float]:
    need = {"CPU": float(options.get("num_cpus", 1.0)), "GPU": float(options.get("num_gpus", 0))}
    need.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    return {k: v for k, v in need.items() if v > 0}


def _fmt(resources: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, (int, float)) else f"{k}: {v}"
                           for k, v in resources.items()) + "}"


def _autoscaler_launching() -> bool:
    """Whether the cluster's autoscaler says it is launching nodes now (its status report in
    the GCS; a cluster without an autoscaler reports none pending)."""
    try:
        import json

        from ray.experimental.internal_kv import _internal_kv_get
        report = json.loads(_internal_kv_get(b"__autoscaling_status") or b"{}")
        report = report.get("autoscaler_report") or {}
        return bool(report.get("pending_launches") or report.get("pending_nodes"))
    except Exception:  # noqa: BLE001 - no answer means we cannot tell: say nothing
        return False


def ray_actor_placed(actor_id: str) -> bool:
    """Whether Ray has placed the actor: it has a worker process (its constructor may still
    run), or it is past creation. False while it waits for resources, or the GCS does not
    know it yet."""
    try:
        from ray._private.state import actors
        info = actors(actor_id=actor_id)
    except Exception:  # noqa: BLE001 - the GCS may not know it yet
        return False
    if not isinstance(info, dict) or not info.get("State"):
        return False
    return info["State"] not in RAY_PENDING_STATES or bool(info.get("Pid"))
