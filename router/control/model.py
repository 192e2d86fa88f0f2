"""The model the engine replicas run: where it is, and the engine config each runs with.
The engine controller resolves both once (router/control/controller.py); tests and
benchmarks that start engines without Serve call the same."""
from __future__ import annotations

from pd_cluster.config import DEFAULT_MODEL, EngineConfig, ModelConfig, resolve_max_model_len
from router.app_config import AppConfig


def model_dir(config: AppConfig) -> str:
    if config.engine.model == DEFAULT_MODEL:
        from pd_cluster.default_model import default_model_path
        return default_model_path()
    return config.engine.model


def replica_engine(config: AppConfig, path: str) -> EngineConfig:
    """`config.engine` with max_model_len resolved as the engine would: resolved once by the
    router and handed to every engine replica, so the router's prompt limits and theirs agree."""
    max_model_len = resolve_max_model_len(config.engine, ModelConfig.from_dir(path))
    return config.engine.model_copy(update={"max_model_len": max_model_len})
