"""The router's one dependency on the engines: EngineClient, one per application.

Implementations: `router.colocated_client.ColocatedClient` (N colocated engines) and
`router.disagg_client.DisaggregatedClient` (P and D replicas, KV pushed between them).
`router.app` calls `start`, then `wait_ready`; the router then calls `generate` for every
engine request it makes (n > 1 makes n of them), `abort` when the client goes away, and
`loads` to route and to export per-replica metrics.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from pd_cluster.config import EngineConfig
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams
from router.app_config import AppConfig
from router.routing import ReplicaLoad, Route


class EngineClient(Protocol):
    @classmethod
    def start(cls, config: AppConfig, engine: EngineConfig,
              actor_options: Mapping[str, dict[str, Any]]) -> EngineClient:
        """Create the engine replicas as Ray actors owned by the caller, `actor_options[role]`
        each ("prefill", "decode"); returns without waiting for them."""

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once every replica has loaded its model; TimeoutError after `timeout_s`."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 route: Route) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative text and tokens, plus delta_text) until
        one is finished. Raises ValueError (a subclass) when the engine refuses the request.
        Closing the iterator early aborts the request and frees its KV on every replica."""

    async def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; unknown or finished ids are ignored."""

    async def loads(self) -> list[ReplicaLoad]:
        """One fresh report per replica (prefill and decode)."""
