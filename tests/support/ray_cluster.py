"""A local Ray for the tests that start actors (the `ray_cluster` fixture of conftest.py), and
stopping it for code that needs a Ray of its own."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from tests.support import REPO as ROOT

# What a test's Ray workers need: the project, whose root holds the `tests` package (actor
# classes defined in a test module are pickled by reference: workers import that module), and
# UCX on TCP, as CPU machines have no RDMA (kept if the caller set one).
RAY_WORKER_ENV = {"PYTHONPATH": os.pathsep.join(
                      [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                  "UCX_TLS": os.environ.get("UCX_TLS", "tcp"),
                  "UCX_WARN_UNUSED_ENV_VARS": "n"}


@contextlib.contextmanager
def environ(updates: dict[str, str]) -> Iterator[None]:
    """Set these environment variables for the block, then restore what was there."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_local_ray():
    """A private local Ray (2 CPUs, no dashboard) whose workers see RAY_WORKER_ENV; the
    environment of this process is left as it was."""
    import ray

    with environ(RAY_WORKER_ENV):          # the raylet, and so every worker, inherits it
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


def stop_shared_ray() -> None:
    """Stop the shared Ray if it runs: for code that starts a Ray of its own (Ray Serve with
    its own settings, the serving benchmarks). The next module that needs it starts it again."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
