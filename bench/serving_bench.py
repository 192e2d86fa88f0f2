"""The serving benchmarks' Ray side: serve a configuration on a private local Ray (HAProxy
ingress as shipped, on free ports) and read the engine actors' own stamps through the router
replica's client. `LocalRayHarness` hands these to bench/harness/sweep.py, which holds the
benchmarks themselves (`python -m bench.serving_sweep` is their command line: `main` here).

Also what any test or benchmark that starts its own Serve app needs: `free_port`,
`haproxy_wanted`, `ingress_env` (tests/support/serve_run.py, bench/router_overhead.py),
`borrow_client` (a copy of the router replica's EngineClient) and `engine_actors` (the app's
engine actor handles: bench/served_vs_offline.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ray

from bench.harness.diagnostics import actor_stages, timeline, ttft_parts_of
from bench.harness.serving_runs import get_text
from bench.harness.sweep import run
from pd_cluster.config import EngineConfig
from router.app import HAPROXY_INGRESS_ENV

APP = "pd"              # the application's name on the benchmarks' Serve instance
# This source tree, where router/ and pd_cluster/ are: the local Ray's workers import them
# from there.
PACKAGES_ROOT = Path(__file__).resolve().parents[1]


# HAProxy's own listeners, on fixed ports by default (metrics 9101, stats 8404, the head's
# fallback Serve proxy 8500) that another Ray cluster on the host may hold.
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                     "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")
# A replica behind HAProxy stays up at least this long when stopped (default 30 s), for load
# balancers to let go of it; nothing needs that of a private cluster being torn down.
DRAINING_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_wanted() -> bool:
    """HAProxy ingress, as shipped, unless RAY_SERVE_ENABLE_HA_PROXY=0 asks for Serve's proxy."""
    return os.environ.get(HAPROXY_INGRESS_ENV, "1") == "1"


def ingress_env(haproxy: bool) -> dict[str, str]:
    """Environment for a private local Ray cluster: HAProxy ingress on, with its listeners on
    free ports so that it starts beside another cluster's, and stopping without the drain
    period; or off (Serve's Python proxy)."""
    if not haproxy:
        return {HAPROXY_INGRESS_ENV: "0"}
    return {HAPROXY_INGRESS_ENV: "1", **DRAINING_ENV,
            **{k: str(free_port()) for k in HAPROXY_PORT_ENVS}}


# -- serving one configuration --------------------------------------------------------------------

@contextlib.contextmanager
def serving(args: dict, opts: argparse.Namespace) -> Iterator[str]:
    """URL of the application built from `args` on a private local Ray; stopped afterwards."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGES_ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)          # the engines inherit them through Ray
    os.environ.update(ingress_env(haproxy_wanted()))    # Serve reads them when Ray starts
    work = Path(tempfile.mkdtemp(prefix="pdsw", dir="/tmp"))     # short: Ray's socket paths
    ray.init(address="local", num_cpus=opts.num_cpus, num_gpus=opts.num_gpus,
             include_dashboard=False, namespace="serve", log_to_driver=False,
             _temp_dir=str(work))
    try:
        with serve_app(args, opts.start_timeout) as url:
            yield url
    finally:
        ray.shutdown()
        keep = os.environ.get("PD_BENCH_KEEP_LOGS")    # a directory: Ray's logs go there
        if keep:
            with contextlib.suppress(OSError):
                shutil.copytree(work / "session_latest" / "logs", Path(keep) / work.name,
                                dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        _wait_gpus_free()


@contextlib.contextmanager
def serve_app(args: dict, start_timeout: float) -> Iterator[str]:
    """URL of the application built from `args`, served on the Ray this process is connected
    to (Serve on a free loopback port) once it answers /health; Serve stopped afterwards."""
    from ray import serve

    from router.app import build_app

    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(build_app(args), name=APP, route_prefix="/")],
                       wait_for_applications_running=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout
        while get_text(f"{url}/health", timeout=5) is None:
            app = serve.status().applications.get(APP)
            if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the application failed to start: {app.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no healthy application after {start_timeout} s")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()


def _wait_gpus_free(timeout: float = 60.0) -> None:
    """Until the engines' processes have given their GPU memory back (when nvidia-smi exists)."""
    deadline = time.monotonic() + timeout
    while shutil.which("nvidia-smi") and time.monotonic() < deadline:
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True).stdout.split()
        if all(float(v) < 2048 for v in used):
            return
        time.sleep(1)


# -- the engine actors' stamps, through the router replica's client -------------------------------

def replica_serving(replica: Any) -> Any:
    """Runs in the router replica: its OpenAIServing, found by a walk through attributes from
    the replica actor (no Serve internals named; gc.get_objects would miss it, Serve freezes
    the startup objects)."""
    from router.serving import OpenAIServing
    seen, frontier = set(), [replica]
    for _ in range(8):
        found = [o for o in frontier if isinstance(o, OpenAIServing)]
        if found:
            return found[0]
        nxt = []
        for obj in frontier:
            for value in getattr(obj, "__dict__", {}).values():
                if id(value) not in seen and hasattr(value, "__dict__"):
                    seen.add(id(value))
                    nxt.append(value)
        frontier = nxt
    raise RuntimeError("no OpenAIServing found in the router replica")


def _replica_client(replica: Any) -> Any:
    """Runs in the router replica: the EngineClient its OpenAIServing calls (it comes back as
    a copy with the same handles)."""
    return replica_serving(replica).client


def borrow_client(timeout_s: float, app: str = APP) -> Any:
    """A copy of the router replica's EngineClient: its engine actors, called from here."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#OpenAIRouter#")]
    if len(names) != 1:
        raise RuntimeError(f"expected one router replica, found {names}")
    replica = ray.get_actor(names[0], namespace="serve")
    return ray.get(replica.__ray_call__.remote(_replica_client), timeout=timeout_s)


def engine_actors(app: str = APP, role: str = "decode", timeout_s: float = 60.0) -> list:
    """The app's READY engine actors of `role` (colocated engines are "decode" ones): from
    its EngineController deployment's membership when the app has one, else from the router
    replica's client (`borrow_client`, while the router replica owns the engines)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is not None and "EngineController" in status.deployments:
        handle = serve.get_deployment_handle("EngineController", app_name=app)
        membership = handle.membership.remote().result(timeout_s=timeout_s)
        return [member.actor for member in membership.ready(role)]
    client = borrow_client(timeout_s, app)
    actors = getattr(client, role, None)        # DisaggregatedClient: .prefill, .decode
    if actors is None:                          # ColocatedClient: .actors, all "decode"
        actors = client.actors if role == "decode" else []
    return list(actors)


def engine_stages(since: float) -> dict | None:
    """Disaggregated: where the time went inside the first P and D, from their own stamps
    (diagnostics.actor_stages, all requests of the run); None otherwise or on failure."""
    try:
        client = borrow_client(30.0)
        if not getattr(client, "prefill", None):
            return None
        p_rows, d_rows, diag = ray.get([client.prefill[0].stage_times.remote(),
                                        client.decode[0].stage_times.remote(),
                                        client.prefill[0].diagnostics.remote(since)], timeout=30)
        return {**actor_stages(p_rows, d_rows, since),
                "prefill_diagnostics": {k: v for k, v in diag.items()
                                        if k not in ("step_log", "kernel_compiles")},
                "prefill_timeline": timeline(p_rows, diag["step_log"], since,
                                             diag["kernel_compiles"])}
    except Exception as e:  # noqa: BLE001 - a diagnostic: never lose the measured point
        return {"error": repr(e)[:300]}


def ttft_parts(report: dict, since: float, measured: slice) -> dict | None:
    """Percentiles (ms) of each part of the measured requests' TTFT, their rows, and P's
    engine steps over the run (bench/harness/diagnostics.py); None when the server
    has no prefill actors."""
    try:
        client = borrow_client(30.0)    # a copy, with the router's stamps as of now
        prefill = list(getattr(client, "prefill", []) or [])
        if not prefill:
            return None
        rows = ray.get([p.stage_times.remote() for p in prefill], timeout=30)
        diag = ray.get([p.diagnostics.remote(since) for p in prefill], timeout=30)
    except Exception as e:  # noqa: BLE001 - a diagnostic: never lose the measured point
        return {"error": repr(e)[:300]}
    return ttft_parts_of(report, measured, client.stamps, rows, diag)


# -- the command line -----------------------------------------------------------------------------

class LocalRayHarness:
    """bench/harness/sweep.py's ServingHarness: each configuration on its own local Ray."""

    def serving(self, args: dict, opts: argparse.Namespace):
        return serving(args, opts)

    def engine_stages(self, since: float) -> dict | None:
        return engine_stages(since)

    def ttft_parts(self, report: dict, since: float, measured: slice) -> dict | None:
        return ttft_parts(report, since, measured)

    def app_engine(self, args: dict) -> EngineConfig:
        from router.app_config import AppConfig

        return AppConfig.from_args(args).engine


def main(argv: Sequence[str] | None, config_path: str | Path) -> int:
    """`python -m bench.serving_sweep`: the benchmarks, each configuration served here from the Serve
    config `config_path`'s args (configs/pd.yaml) with its `--set` overrides."""
    return run(argv, LocalRayHarness(), config_path)
