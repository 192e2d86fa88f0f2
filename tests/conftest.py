"""Shared fixtures, and the `gpu` marker's skip on machines without CUDA.

Markers (registered in pyproject.toml): `slow` (left out by `-m "not slow"`, the quick run),
`serve` (starts Ray Serve or another HTTP server), `gpu` (needs CUDA: skipped without it).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

from tests.support.ray_cluster import environ, start_local_ray, stop_shared_ray

SHARED_SERVER = "default_server"
SHARED_SERVER_LATER = "default_server_later"
OWN_RAY = "own_ray"
RAY_FIXTURES = ("ray_cluster", OWN_RAY, SHARED_SERVER, SHARED_SERVER_LATER)

# Each Ray worker, server and CLI process the tests start imports the project afresh; where
# bytecode writing is off (PYTHONDONTWRITEBYTECODE, as on some CI images) each compiled every
# module again. They inherit this process's environment.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _run_server_tests_last(items)
    _mark_ray_and_server_tests_slow(items)
    _skip_gpu_tests_without_cuda(items)


def _run_server_tests_last(items: list[pytest.Item]) -> None:
    """Each group in its collected order: the rest, then the tests on a Ray of their own
    (`own_ray`), then the `serve` tests, then those that start `default_server` partway
    (`default_server_later`), then those on `default_server`. A server runs on a Ray of its
    own too, and all of these stop the shared `ray_cluster` first: this way that one starts
    once, and `default_server` (stopped by any other server or by the shared Ray starting
    again) starts once too."""
    def group(item: pytest.Item) -> int:
        fixtures = getattr(item, "fixturenames", ())
        if SHARED_SERVER in fixtures:
            return 4
        if SHARED_SERVER_LATER in fixtures:
            return 3
        if item.get_closest_marker("serve"):
            return 2
        return 1 if OWN_RAY in fixtures else 0
    items.sort(key=group)       # stable: the collected order within each group


def _mark_ray_and_server_tests_slow(items: list[pytest.Item]) -> None:
    """The quick run (`-m "not slow"`) leaves out every test that starts Ray or a server:
    their start-up alone takes seconds to most of a minute on 2 cores."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.get_closest_marker("serve") or any(f in fixtures for f in RAY_FIXTURES):
            item.add_marker(pytest.mark.slow)


def _skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
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
def tokenizer(default_model_dir: str):
    """The default model's tokenizer."""
    from pd_cluster.tokenizer import load_tokenizer

    loaded = load_tokenizer(default_model_dir)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="session")
def helm():
    """A real helm v3 binary (fetched once: tests/support/helm.py)."""
    from tests.support.helm import helm_binary

    return helm_binary()


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory) -> str:
    """A folder where tiny random checkpoints are saved once per test session."""
    return str(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def _ray_session():
    yield
    stop_shared_ray()


@pytest.fixture(scope="module")
def own_ray(_ray_session) -> None:
    """For a module that starts a Ray of its own (several nodes, other settings): the shared
    `ray_cluster` is stopped first, and such modules run after those that share it
    (pytest_collection_modifyitems), so that it is not started again."""
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


@pytest.fixture(scope="session")
def default_server(_ray_session) -> Iterator[str]:
    """URL of the real `serve run configs/pd.yaml` as shipped (disaggregated, 1 P + 1 D), with
    API_KEY required: one server for every module that needs nothing else of it (starting and
    stopping one takes most of a minute on 2 cores). It stops the shared `ray_cluster`, so
    the tests that use it run last (pytest_collection_modifyitems)."""
    from tests.support.serve_run import API_KEY, API_KEY_ENV, serve_run

    with environ({API_KEY_ENV: API_KEY}), serve_run({"api_key_env": API_KEY_ENV}) as url:
        yield url


@pytest.fixture
def default_server_later(request: pytest.FixtureRequest) -> Callable[[], str]:
    """`default_server`'s URL when called (started then, if it has not been): for a test that
    first serves something else on a Ray of its own, which would stop it. Such tests run just
    before those on `default_server` (pytest_collection_modifyitems), so it still starts once."""
    return lambda: request.getfixturevalue(SHARED_SERVER)
