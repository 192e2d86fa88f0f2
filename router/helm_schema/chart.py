"""The hand-kept part of helm/values.schema.json: the chart's own values, which no tree field
holds (the image, the Ray pods, Kubernetes objects), and its refinements of the tree's values
(what its templates read and so require, a tree validator's rule that a type cannot say).
generate.py lays PROPERTIES over tree.py's part; where both say something, this part wins.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Schema = dict[str, Any]
# EngineConfig's block_size validator asks for a power of two, which a type cannot say.
BLOCK_SIZES = [2 ** n for n in range(9)]
GROUP_SIZES = ("replicas", "gpusPerReplica", "cpusPerReplica", "replicasPerPod", "shmSize")


def _object(properties: Schema, description: str = "", required: Sequence[str] = ()) -> Schema:
    """A mapping of these properties and no others."""
    node: Schema = {"type": "object", "additionalProperties": False, "properties": properties}
    if description:
        node["description"] = description
    if required:
        node["required"] = list(required)
    return node


def _map_of(*types: str) -> Schema:
    """A mapping of any names to values of these JSON types."""
    return {"type": "object", "additionalProperties": {"type": types[0] if len(types) == 1
                                                       else list(types)}}


def _placement() -> Schema:
    """The properties of a Ray node group's pods that head, prefill and decode share."""
    return {
        "resources": _object({"requests": _map_of("string", "number"),
                              "limits": _map_of("string", "number")},
                             "Kubernetes requests / limits of the container (nvidia.com/gpu "
                             "and RDMA are added by the chart)"),
        "nodeSelector": _map_of("string"),
        "tolerations": {"type": "array", "items": {"type": "object"}},
        "affinity": {"type": "object"},
        "rayStartParams": {**_map_of("string", "number", "boolean"),
                           "description": "extra `ray start` flags"},
    }


def _worker_group(description: str) -> Schema:
    """A worker group of engine replicas; tree.py adds replicas and tensorParallelSize."""
    return _object({
        **_placement(),
        "gpusPerReplica": {"type": "integer", "minimum": 0, "maximum": 16,
                           "description": "GPUs per replica; 0 runs on CPU"},
        "cpusPerReplica": {"type": "number", "exclusiveMinimum": 0,
                           "description": "Ray CPUs each replica reserves"},
        "replicasPerPod": {"type": "integer", "minimum": 1,
                           "description": "replicas on one pod"},
        "shmSize": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$",
                    "description": "size of /dev/shm (NCCL / UCX shared memory)"},
    }, description, GROUP_SIZES)


HEADER: Schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "pd-cluster chart values",
    "type": "object",
    "additionalProperties": False,
    "required": ["mode", "transport", "image", "engine", "limits", "kvPool", "kvTiers", "routing",
                 "router", "planner", "head", "prefill", "decode"],
}

PROPERTIES: Schema = {
    # -- refinements of the tree's values
    "engine": {"required": ["model"], "properties": {"blockSize": {"enum": BLOCK_SIZES}}},
    "planner": {"required": ["enabled"]},
    "router": _object({
        "autoscaling": _object(
            {"enabled": {"type": "boolean", "description": "false: router.replicas replicas"}},
            "Serve's autoscaling_config of the router (args router_autoscaling, without "
            "enabled); minReplicas <= initialReplicas <= maxReplicas is checked at render "
            "time", ["enabled"]),
    }, "the router deployment (Serve deployment OpenAIRouter): a fixed replica count, or Serve "
       "autoscaling", ["replicas", "autoscaling"]),
    "prefill": _worker_group("prefill worker group; ignored in colocated mode"),
    "decode": _worker_group("decode worker group (the engines, in colocated mode)"),
    # -- the chart's own values
    "global": {"type": "object"},
    "nameOverride": {"type": "string"},
    "fullnameOverride": {"type": "string"},
    "image": _object({
        "repository": {"type": "string", "minLength": 1},
        "tag": {"type": "string", "description": "empty: the chart's appVersion"},
        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    }, required=["repository"]),
    "imagePullSecrets": {"type": "array", "items": {
        "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
    "rayVersion": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+\.[0-9]+",
                   "description": "the Ray inside the image"},
    "apiKey": _object({
        "secretName": {"type": "string", "description": "a Secret holding the API key; "
                                                        "empty: no auth"},
        "secretKey": {"type": "string", "minLength": 1},
        "envName": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                    "description": "the router's env var of the key (args api_key_env)"},
    }),
    "extraEnv": {"type": "array", "items": {"type": "object", "required": ["name"]},
                 "description": "more env vars of every Ray container"},
    "head": _object(_placement(), "the Ray head: GCS, dashboard, Serve controller and router "
                                  "replicas; no GPUs"),
    "rdma": _object({
        "enabled": {"type": "boolean"},
        "resourceName": {"type": "string", "minLength": 1},
        "count": {"type": "integer", "minimum": 1},
    }, "RDMA for the KV transport (InfiniBand / RoCE through a device plugin, or AWS EFA)"),
    "ucx": _object({
        "tls": {"type": "string", "description": "UCX_TLS; empty: from rdma.enabled and GPUs"},
        "netDevices": {"type": "string", "description": "UCX_NET_DEVICES; empty: UCX chooses"},
        "env": {**_map_of("string", "number", "boolean"),
                "propertyNames": {"pattern": "^(UCX|NIXL)_[A-Z0-9_]+$"}},
    }, "UCX settings of the engine pods (NIXL and ucxx sit on UCX)"),
    "podSecurityContext": {"type": "object"},
    "containerSecurityContext": {"type": "object"},
    "service": _object({
        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "haproxy": {"type": "boolean", "description": "HAProxy ingress "
                    "(RAY_SERVE_ENABLE_HA_PROXY=1) instead of Serve's Python proxy"},
        "annotations": _map_of("string"),
    }, "the router's endpoint: the OpenAI API on every Ray pod"),
    "metrics": _object({
        "serviceMonitor": _object({
            "enabled": {"type": "boolean"},
            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
            "labels": _map_of("string"),
        }, "a Prometheus Operator ServiceMonitor of Ray's and the router's metrics"),
        "dashboard": _object({"enabled": {"type": "boolean"}, "labels": _map_of("string")},
                             "the Grafana dashboard in a ConfigMap for Grafana's sidecar"),
    }),
}

# Rules between values that JSON schema can say (the chart's templates check the others).
RULES: list[Schema] = [{
    "description": "disaggregated and pooled modes need at least one prefill replica",
    "if": {"properties": {"mode": {"enum": ["disaggregated", "pooled"]}}},
    "then": {"properties": {"prefill": {"properties": {"replicas": {"minimum": 1}}}}},
}]
