"""The ASGI app a router replica hands Serve the moment it is constructed.

    STARTING  the replica waits for the engine controller to resolve the model (the bundled
              one is fetched and converted on first use) and loads the tokenizer: every
              request is answered at once, 503 with what it waits for (`/health`: status
              "starting"), instead of hanging in Serve's queue
    SERVING   the FastAPI app of router/api.py answers everything
    FAILED    the start failed: 503 naming why; the deployment's health check fails too, so
              Serve replaces the replica and says why in its log

STARTING -> SERVING | FAILED; nothing leaves SERVING or FAILED. Every answer, in every state,
names the replica in a header (`x-pd-router`).
"""
from __future__ import annotations

import enum
import json
import os
from typing import Any

from router.errors import unavailable

Scope = dict[str, Any]


class StartState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    FAILED = "failed"


_NEXT = {StartState.STARTING: {StartState.SERVING, StartState.FAILED},
         StartState.SERVING: set(), StartState.FAILED: set()}


class ReplicaApp:
    def __init__(self, name: str, header: str) -> None:
        self.name, self.header = name, header
        self._named = (header.encode(), name.encode())
        self.state = StartState.STARTING
        self.reason = "starting"
        self.app: Any = None

    def waiting_for(self, reason: str) -> None:
        """What the start waits for now (said in every 503)."""
        self.reason = reason

    def serve(self, app: Any) -> None:
        self._move(StartState.SERVING)
        self.app = app

    def fail(self, reason: str) -> None:
        self._move(StartState.FAILED)
        self.reason = reason

    def _move(self, state: StartState) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"router replica cannot go from {self.state.value} to "
                               f"{state.value}")
        self.state = state

    async def __call__(self, scope: Scope, receive, send) -> None:
        if self.app is not None and scope["type"] == "http":
            async def send_named(message: dict) -> None:
                if message["type"] == "http.response.start":
                    message = {**message,
                               "headers": [*message.get("headers", ()), self._named]}
                await send(message)
            await self.app(scope, receive, send_named)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await self._unavailable(scope, send)
        # A websocket is refused by returning without accepting it.

    async def _unavailable(self, scope: Scope, send) -> None:
        if scope.get("path") == "/health":
            body = {"status": self.state.value, "detail": self.reason,
                    "router": {"replica": self.name, "pid": os.getpid()}}
            headers: dict[str, str] = {}
        else:
            verb = "is starting" if self.state is StartState.STARTING else "failed to start"
            error = unavailable(f"The service {verb}: {self.reason}.")
            body, headers = error.body(), error.headers
        payload = json.dumps(body).encode()
        raw = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()),
               self._named]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": 503, "headers": raw})
        await send({"type": "http.response.body", "body": payload})


async def _lifespan(receive, send) -> None:
    """Serve runs the app's lifespan once, at the replica's start and stop; the FastAPI app
    that comes later has no startup or shutdown work of its own."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
