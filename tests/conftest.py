"""Shared fixtures, and the `gpu` marker's skip on machines without CUDA.

Markers (registered in pyproject.toml): `slow` (left out by `-m "not slow"`, the quick run),
`serve` (starts Ray Serve or another HTTP server), `gpu` (needs CUDA: skipped without it).
"""
from __future__ import annotations

import pytest

from ray_support import start_local_ray, stop_shared_ray


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (converted on first use, then taken from the local cache)."""
    from pd_cluster.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory) -> str:
    """A folder where tiny random checkpoints are saved once per test session."""
    return str(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def _ray_session():
    yield
    stop_shared_ray()


@pytest.fixture(scope="module")
def ray_cluster(_ray_session):
    """The `ray` module, connected to a local Ray shared by the modules that ask for it: the
    first one starts it, the next ones reuse it (their actors are their own to kill), and it
    stops at the end of the session or when a test needs a Ray of its own (stop_shared_ray)."""
    import ray

    if not ray.is_initialized():
        start_local_ray()
    return ray
