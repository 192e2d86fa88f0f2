"""A router replica's ASGI app (router/replica_app.py): while the replica starts every request
is answered at once with 503 and what it waits for; a failed start says why; once serving, the
real app answers; every answer names the replica. And the line a router logs when the service
can first serve (router/streams.py)."""
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


def test_the_ready_line_comes_once_when_every_pool_can_serve_and_a_warning_when_one_cannot():
    import logging

    from router.control.membership import EngineMember, Membership, ReplicaState
    from router.streams import serving_change

    def membership(version: int, prefill: ReplicaState, decode: ReplicaState) -> Membership:
        return Membership(version, "disaggregated", {"prefill": 1, "decode": 1},
                          (EngineMember("prefill", 0, prefill), EngineMember("decode", 0, decode)))
    url = "http://localhost:8000/v1"
    starting = membership(1, ReplicaState.STARTING, ReplicaState.READY)
    ready = membership(2, ReplicaState.READY, ReplicaState.READY)
    assert serving_change(None, starting, url) is None
    assert serving_change(starting, ready, url) == (
        logging.INFO, "pd-cluster is ready: http://localhost:8000/v1 (prefill 1/1 ready, "
                      "decode 1/1 ready)")
    assert serving_change(ready, membership(3, ReplicaState.READY, ReplicaState.READY), url) \
        is None
    level, line = serving_change(ready, membership(4, ReplicaState.READY, ReplicaState.DEAD), url)
    assert level == logging.WARNING
    assert line.startswith("pd-cluster cannot serve now: prefill 1/1 ready, decode 0/1 ready")
