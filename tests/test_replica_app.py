"""A router replica's ASGI app (router/replica_app.py): while the replica starts every request
is answered at once with 503 and what it waits for; a failed start says why; once serving, the
real app answers; every answer names the replica."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from router.replica_app import ReplicaApp, StartState

HEADER = "x-pd-router"


def served() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": []}
    return app


def test_a_starting_replica_answers_503_at_once_saying_what_it_waits_for():
    replica = ReplicaApp("r1", HEADER)
    replica.waiting_for("loading the tokenizer")
    with TestClient(replica) as client:
        resp = client.post("/v1/completions", json={"model": "default", "prompt": "hi"})
        health = client.get("/health")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
    assert resp.headers[HEADER] == "r1"
    assert resp.json() == {"error": {
        "message": "The service is starting: loading the tokenizer.", "type": "server_error",
        "param": None, "code": "engine_unavailable"}}
    assert health.status_code == 503 and health.headers[HEADER] == "r1"
    assert health.json()["status"] == "starting"
    assert health.json()["detail"] == "loading the tokenizer"


def test_a_failed_start_says_why_in_every_answer():
    replica = ReplicaApp("r1", HEADER)
    replica.fail("engine.model: '/m' has no tokenizer files")
    with TestClient(replica) as client:
        resp = client.get("/v1/models")
        health = client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == \
        "The service failed to start: engine.model: '/m' has no tokenizer files."
    assert health.json()["status"] == "failed"


def test_a_serving_replica_hands_requests_to_its_app_and_names_itself():
    replica = ReplicaApp("r1", HEADER)
    replica.serve(served())
    with TestClient(replica) as client:
        resp = client.get("/v1/models")
        missing = client.get("/nowhere")
    assert resp.status_code == 200 and resp.json() == {"object": "list", "data": []}
    assert resp.headers[HEADER] == "r1" and missing.headers[HEADER] == "r1"
    assert missing.status_code == 404
    assert replica.state is StartState.SERVING


def test_a_replica_leaves_serving_or_failed_never():
    replica = ReplicaApp("r1", HEADER)
    replica.serve(served())
    with pytest.raises(RuntimeError, match="from serving to failed"):
        replica.fail("late")
    failed = ReplicaApp("r2", HEADER)
    failed.fail("no model")
    with pytest.raises(RuntimeError, match="from failed to serving"):
        failed.serve(served())
