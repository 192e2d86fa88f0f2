"""The HTTP surface: FastAPI routes over OpenAIServing, auth, body limits, error bodies.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these three need
`Authorization: Bearer <key>` when an API key or tenants are configured: router/tenants.py), GET /health (each engine tier:
ready / degraded / pending, and why a replica is pending; 503 while a tier has no READY
replica), GET /metrics.
Every error, ours or Starlette's (unknown route, wrong method), is an OpenAI error body.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.control.membership import TierState
from router import tenants
from router.errors import APIError, ErrorCode, bad_request, internal, too_large
from router.serving import OpenAIServing
from router.streams import LoadMonitor, MembershipWatcher
from router.tenants import Tenants

logger = logging.getLogger(__name__)
# Body size limit: room for the longest allowed prompt as JSON-escaped text or as token ids.
BODY_BYTES_BASE = 1 << 20
BODY_BYTES_PER_TOKEN = 32


class Router:
    """What the routes need: serving, load monitor, membership watcher (None: the client's
    engines are fixed, as in tests), who may call (None: anybody), limits, and this replica's
    name (the `x-pd-router` header of every answer)."""

    def __init__(self, serving: OpenAIServing, monitor: LoadMonitor,
                 watcher: MembershipWatcher | None, tenants: Tenants | None,
                 name: str = "") -> None:
        self.serving, self.monitor, self.watcher, self.tenants = serving, monitor, watcher, tenants
        self.name = name or f"router-{os.getpid()}"
        self.max_body_bytes = BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * serving.max_prompt_tokens
        self.created = int(time.time())

    def start_background(self) -> None:
        """Load polling and the membership long poll, on the running event loop, once."""
        self.monitor.ensure_started()
        if self.watcher is not None:
            self.watcher.ensure_started()

    def health(self) -> tuple[dict[str, Any], bool]:
        """/health's body, and whether requests can be served (every tier has a READY
        replica): ok (every wanted replica READY) | degraded | unavailable."""
        if self.watcher is None:
            return {"status": "ok", "router": {"replica": self.name, "pid": os.getpid()}}, True
        m = self.watcher.membership
        serving = m is not None and m.serving()
        ready = serving and all(m.tier_state(r) is TierState.READY for r in m.roles())
        body: dict[str, Any] = {
            "status": "ok" if ready else "degraded" if serving else "unavailable",
            "router": {"replica": self.name, "pid": os.getpid()}}
        if m is not None:
            body.update(membership_version=m.version, tiers=m.tiers())
        return body, serving

    def authorize(self, request: Request) -> None:
        """Check the API key and note whose it is for the serving code (tenants.CURRENT);
        also starts the background polls, which need the running event loop."""
        self.start_background()
        if self.tenants is not None:
            tenants.CURRENT.set(self.tenants.identify(request.headers.get("authorization", "")))

    async def json_body(self, request: Request) -> Any:
        """The request's JSON, read up to the size limit (413 beyond, 400 if malformed)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large(self.max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_large(self.max_body_bytes)
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):   # RecursionError: too deep
            raise bad_request("We could not parse the JSON body of your request.",
                              code=ErrorCode.INVALID_JSON) from None

    def models(self) -> dict[str, Any]:
        config = self.serving.config
        return {"object": "list",
                "data": [{"id": config.engine.model, "object": "model", "created": self.created,
                          "owned_by": "pd-cluster", "max_model_len": self.serving.max_model_len}]}


def _respond(result: dict[str, Any] | Any) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def create_app(router: Router) -> FastAPI:
    """The ASGI app of one router replica."""
    app = FastAPI(title="pd-cluster", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = router.serving.metrics

    def error_response(e: APIError) -> JSONResponse:
        metrics.errors.labels(e.kind).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), code=ErrorCode.NOT_FOUND
                                       if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(internal(f"internal error: {e!r}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        router.start_background()
        body, serving = router.health()
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        try:
            await router.monitor.refresh()
        except Exception as e:  # noqa: BLE001 - serve the last reports rather than nothing
            logger.warning("load refresh for /metrics failed: %r", e)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        router.authorize(request)
        return router.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        router.authorize(request)
        return _respond(await router.serving.completions(await router.json_body(request),
                                                         request.headers))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        router.authorize(request)
        return _respond(await router.serving.chat(await router.json_body(request),
                                                  request.headers))

    return app
