"""The real `serve run configs/pd.yaml`, started for a test module and stopped after it."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from bench.serving_bench import free_port, haproxy_wanted, ingress_env
from router.app import HAPROXY_RETRY_ENV
from tests.support import REPO as ROOT
from tests.support.ray_cluster import environ, stop_shared_ray
from tests.support.waiting import wait_until  # noqa: E402

SERVE_CONFIG = ROOT / "configs" / "pd.yaml"
START_TIMEOUT_S = 600
HEALTH_POLL_S = 0.25        # a /health answer costs the router about a millisecond
# The shared default application (conftest.py's `default_server`) requires this key, so that
# its modules can test a wrong one.
API_KEY_ENV, API_KEY = "PD_TEST_API_KEY", "sk-pd-test"


def health(url: str) -> tuple[int, dict | None]:
    """The app's own /health: (status, its JSON body); (0, None) while it has no answer of its
    own (before the app's routes exist HAProxy answers 404 with no JSON body)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return 0, None
    except (OSError, ValueError):
        return 0, None


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, serving: bool) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        status, body = health(url)
        return status == 200 if serving else bool(body and "tiers" in body)   # router up
    try:
        wait_until(healthy, START_TIMEOUT_S, HEALTH_POLL_S)
    except TimeoutError:
        raise TimeoutError(f"no healthy server after {START_TIMEOUT_S} s:\n"
                           f"{log.read_text()[-4000:]}") from None


@contextlib.contextmanager
def serve_run(args_overrides: dict, num_cpus: int = 2, serving: bool = True) -> Iterator[str]:
    """URL of `serve run` on a temp copy of configs/pd.yaml (args updated), on a private local
    Ray (`num_cpus` logical CPUs; the tests' shared Ray is stopped first) and a free loopback
    port, once /health says it serves (or, not `serving`, once the router answers /health at
    all); everything is stopped afterwards.

    Ray starts with HAProxy ingress, as shipped (RAY_SERVE_ENABLE_HA_PROXY=0 in the
    environment: Serve's Python proxy instead), HAProxy's other listeners on free ports, and
    its retry policy (router/app.py HAPROXY_RETRY_ENV).
    Serve is started first with that port, so the file's port 8000 is ignored by `serve run`
    and parallel runs do not clash.
    """
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    with environ({**ingress_env(haproxy_wanted()), **HAPROXY_RETRY_ENV}), \
            _serve_run(args_overrides, num_cpus, serving) as url:
        yield url


@contextlib.contextmanager
def _serve_run(args_overrides: dict, num_cpus: int, serving: bool) -> Iterator[str]:
    work = Path(tempfile.mkdtemp(prefix="pdr", dir="/tmp"))   # short: Ray's socket paths
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    config["applications"][0]["args"].update(args_overrides)
    (work / "pd.yaml").write_text(yaml.safe_dump(config))
    stop_shared_ray()       # the actor tests' Ray, if it runs: this one has its own settings
    ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="serve",
                   log_to_driver=False, _temp_dir=str(work / "ray"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    log = work / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run",
                                 "--address", ctx.address_info["gcs_address"],
                                 str(work / "pd.yaml")], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, serving)
        yield url
    finally:
        # The private Ray goes down whole (replicas, engines, HAProxy with them): Serve's
        # graceful stop of the app (Ctrl-C to `serve run`, then serve.shutdown) would drain
        # requests no test has left, and takes about 5 s on 2 cores.
        proc.kill()
        proc.wait(timeout=10)
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def metrics_of(server: str) -> dict[str, list]:
    text = httpx.get(f"{server}/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def replica_values(metrics: dict[str, list], name: str) -> list[float]:
    return [s.value for s in metrics[name] if s.labels.get("role")]
