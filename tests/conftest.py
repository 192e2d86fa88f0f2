"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (converted on first use, then taken from the local cache)."""
    from pd_cluster.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory) -> str:
    """A folder where tiny random checkpoints are saved once per test session."""
    return str(tmp_path_factory.mktemp("tiny_models"))
