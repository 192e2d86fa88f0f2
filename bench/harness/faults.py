"""bench/chaos.py's faults: finding the application's processes (router replicas through
/health, the controller, engine actors by name, the KV pool) and injecting each fault into
them. Each injector takes (URL, context) and returns what it did, "at" being the monotonic
time of the fault and "pid" the process that is gone (when one is). Then whether the
application is whole again, and whether each replacement engine is in use."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import ray

from bench.harness.serving_runs import get_text
from bench.serving_bench import APP
from transfer.state import LEASE_S

STALL_S = LEASE_S + 2.0         # SIGSTOP of P: past the KV transfer's lease
BUSY_POLL_S = 0.02              # how often an engine is asked whether it has work


def alive_actors() -> list[dict]:
    from ray._private.state import actors
    return [a for a in actors().values() if a["State"] == "ALIVE"]


def engine_actor(role: str, replica: int = 0) -> tuple[Any, int]:
    """The application's engine actor of `role` and its process id."""
    prefix = f"pd-{APP}-{role}-{replica}"
    for a in alive_actors():
        if a.get("Name", "").startswith(prefix):
            return ray.get_actor(a["Name"], namespace=a.get("RayNamespace")), a["Pid"]
    raise RuntimeError(f"no live engine actor named {prefix}*")


def pid_of_class(name: str) -> int:
    pids = [a["Pid"] for a in alive_actors() if name in a["ActorClassName"]]
    if len(pids) != 1:
        raise RuntimeError(f"expected one live {name} actor, found {len(pids)}")
    return pids[0]


def when_busy(actor: Any, timeout: float) -> dict:
    """Once the engine has a request in its batch: its load then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = ray.get(actor.load.remote(), timeout=10)
        if load.num_running + load.num_waiting:
            return {"running": load.num_running, "waiting": load.num_waiting,
                    "kv_blocks_used": load.kv_blocks_used}
        time.sleep(BUSY_POLL_S)
    raise TimeoutError(f"the engine had no request for {timeout:g} s")


def kill(pid: int, sig: int = signal.SIGKILL) -> float:
    os.kill(pid, sig)
    return time.monotonic()


def routers(url: str, tries: int = 40) -> dict[str, int]:
    """Router replica -> its process id, from /health answers (HAProxy spreads them)."""
    seen: dict[str, int] = {}
    for _ in range(tries):
        body = json.loads(get_text(f"{url}/health", timeout=10) or "{}")
        if "router" in body:
            seen[body["router"]["replica"]] = body["router"]["pid"]
    return seen


def fault_router(url: str, ctx: dict) -> dict:
    seen = routers(url)
    if len(seen) < 2:
        raise RuntimeError(f"the router fault needs two router replicas, saw {sorted(seen)}")
    victim = sorted(seen)[0]
    return {"at": kill(seen[victim]), "router": victim, "pid": seen[victim]}


def fault_controller(url: str, ctx: dict) -> dict:
    pid = pid_of_class("EngineController")
    return {"at": kill(pid), "pid": pid}


def fault_engine(role: str) -> Callable[[str, dict], dict]:
    def inject(url: str, ctx: dict) -> dict:
        actor, pid = engine_actor(role)
        busy = when_busy(actor, ctx["busy_timeout"])
        return {"at": kill(pid), "pid": pid, **busy}
    return inject


def fault_stall(url: str, ctx: dict) -> dict:
    actor, pid = engine_actor("prefill")
    busy = when_busy(actor, ctx["busy_timeout"])
    at = kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    return {"at": at, "stopped_s": STALL_S, "stopped_pid": pid, **busy}


def fault_tp_rank(url: str, ctx: dict) -> dict:
    import psutil
    actor, pid = engine_actor("decode")
    busy = when_busy(actor, ctx["busy_timeout"])
    ranks = [c for c in psutil.Process(pid).children(recursive=True)
             if c.name().startswith(("python", "ray", "pd"))]
    if not ranks:
        raise RuntimeError("the decode replica has no rank process of its own (TP=1?)")
    return {"at": kill(ranks[-1].pid), "pid": pid, "rank_pid": ranks[-1].pid, **busy}


def fault_kv_pool(url: str, ctx: dict) -> dict:
    pid = pid_of_class("DistributedKVCache")
    return {"at": kill(pid), "pid": pid}


def fault_node(url: str, ctx: dict) -> dict:
    cluster, node = ctx["cluster"], ctx["nodes"]["prefill"]
    actor, _ = engine_actor("prefill")
    busy = when_busy(actor, ctx["busy_timeout"])
    at = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    return {"at": at, **busy}


FAULTS: dict[str, Callable[[str, dict], dict]] = {
    "router": fault_router, "controller": fault_controller,
    "prefill": fault_engine("prefill"), "decode": fault_engine("decode"),
    "stall": fault_stall, "tp_rank": fault_tp_rank, "kv_pool": fault_kv_pool,
    "node": fault_node}


# -- the application whole again ----------------------------------------------------------------

def whole(url: str, args: dict, gone_pid: int | None) -> bool:
    """Every router replica and engine replica of the shape up and serving (/health "ok"),
    and none of them the process the fault killed."""
    body = json.loads(get_text(f"{url}/health", timeout=10) or "{}")
    if body.get("status") != "ok":
        return False
    up = routers(url, tries=4 * args["router_replicas"])
    engines = [a for a in alive_actors() if a.get("Name", "").startswith(f"pd-{APP}-")]
    controllers = [a for a in alive_actors() if "EngineController" in a["ActorClassName"]]
    pids = set(up.values()) | {a["Pid"] for a in engines + controllers}
    return (len(up) == args["router_replicas"] and len(controllers) == 1
            and len(engines) == args["num_prefill"] + args["num_decode"]
            and gone_pid not in pids)


def wait_whole(url: str, args: dict, gone_pid: int | None, timeout: float) -> float:
    """Seconds until the application is `whole` again."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if whole(url, args, gone_pid):
            return round(time.monotonic() - began, 1)
        time.sleep(1)
    raise TimeoutError(f"the application was not whole again within {timeout:g} s")


def engine_pids() -> dict[str, int]:
    return {a["Name"]: a["Pid"] for a in alive_actors()
            if a.get("Name", "").startswith(f"pd-{APP}-")}


def replacements_used(before: dict[str, int]) -> dict[str, bool]:
    """Each engine actor started since `before`: whether it moved KV (a P pushed, a D took a
    prompt's KV in) - the replacement is in use, not merely up."""
    used = {}
    for name, pid in engine_pids().items():
        if before.get(name) != pid:
            load = ray.get(ray.get_actor(name, namespace="serve").load.remote(), timeout=30)
            used[name] = load.kv_bytes_transferred > 0
    return used
