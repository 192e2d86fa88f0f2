"""The engine controller's replica dies and its engines do not (router/control/controller.py),
through the real `serve run configs/pd.yaml` (1 prefill + 1 decode, one router, HAProxy),
driven with the `openai` client:

- SIGKILL of the controller's process while 16 streams run: every stream ends with the
  exact greedy text, every request sent after the kill succeeds, and a replacement
  controller adopts the same named engine actors (same ids, each model loaded once, a new
  membership epoch) within ADOPTED_WITHIN_S;
- `serve delete` of the application stops its detached engines within STOPPED_WITHIN_S (the
  controller's graceful stop kills them, well before their leases would lapse).
(An engine whose lease lapses stops itself: tests/actors/test_engine_lease.py.)
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from actors.engine_lease import ENGINE_LEASE_S  # noqa: E402
from router.control.controller import STOP_WITHIN_S  # noqa: E402
from tests.support.serve_run import health, serve_run  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]
APP = "pd"
ARGS = {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1}
ENGINES = (f"pd-{APP}-prefill-0", f"pd-{APP}-decode-0")
STREAMS, LONG = 16, 48
PROBE_EVERY_S = 0.5
PROBE_FOR_S = 20.0        # requests sent after the kill, one every PROBE_EVERY_S
# Serve's health check of the controller (2 s), a new replica process importing Ray Serve
# on 2 cores busy with the streams, the adoption: well within the engines' lease, which a
# replacement must renew before it lapses.
ADOPTED_WITHIN_S = ENGINE_LEASE_S
# The controller's graceful stop kills them (a lapsed lease would take ENGINE_LEASE_S).
STOPPED_WITHIN_S = STOP_WITHIN_S + 10.0


@pytest.fixture(scope="module")
def server():
    with serve_run(ARGS) as url:
        yield url


def prompt(i: int) -> str:
    return f"Story number {i}: once upon a time, in a land far away, there lived"


async def stream(client, i: int, started: asyncio.Event | None = None) -> str:
    text = ""
    chunks = await client.completions.create(model="default", prompt=prompt(i),
                                             max_tokens=LONG, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    async for chunk in chunks:
        text += chunk.choices[0].text if chunk.choices else ""
        if started is not None and text:
            started.set()
    return text


def client_of(url: str):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                              timeout=300)


def controller_pid() -> int:
    from ray._private.state import actors
    alive = [a for a in actors().values() if a["State"] == "ALIVE"
             and "EngineController" in a["ActorClassName"]]
    assert len(alive) == 1, alive
    return alive[0]["Pid"]


def engines() -> dict[str, tuple[str, int]]:
    """Name → (actor id, model loads) of the application's engine actors."""
    import ray
    out = {}
    for name in ENGINES:
        actor = ray.get_actor(name)
        out[name] = (actor._actor_id.hex(), ray.get(actor.load.remote(), timeout=30).model_loads)
    return out


def membership():
    from ray import serve
    handle = serve.get_deployment_handle("EngineController", app_name=APP)
    return handle.membership.remote(-1, 0.0).result(timeout_s=5)


def test_controller_killed_under_load_engines_adopted_and_no_request_fails(server: str):
    async def reference() -> list[str]:
        async with client_of(server) as client:
            return await asyncio.gather(*[stream(client, i) for i in range(STREAMS)])
    expected = asyncio.run(reference())
    before, old = engines(), membership()
    assert all(loads == 1 for _, loads in before.values()), before
    pid = controller_pid()

    async def adoption(killed: float) -> float:
        """Seconds from the kill until a replacement controller serves a new epoch."""
        while True:
            try:
                m = await asyncio.wait_for(asyncio.to_thread(membership), 10)
                if m.epoch != old.epoch and m.serving():
                    return time.monotonic() - killed
            except Exception:  # noqa: BLE001 - no controller replica yet
                pass
            await asyncio.sleep(0.5)

    async def under_kill() -> tuple[list, list, float]:
        events = [asyncio.Event() for _ in range(STREAMS)]
        async with client_of(server) as client:
            streams = [asyncio.ensure_future(stream(client, i, events[i]))
                       for i in range(STREAMS)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 120)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            adopted = asyncio.ensure_future(asyncio.wait_for(adoption(killed),
                                                             ADOPTED_WITHIN_S))
            probes = []
            while time.monotonic() - killed < PROBE_FOR_S:
                probes.append(asyncio.ensure_future(client.completions.create(
                    model="default", prompt="The capital of France is", max_tokens=4,
                    temperature=0)))
                await asyncio.sleep(PROBE_EVERY_S)
            answers = await asyncio.gather(*probes, return_exceptions=True)
            texts = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True),
                                           300)
            took = await adopted
        return texts, [a if isinstance(a, Exception) else a.choices[0].finish_reason
                       for a in answers], took
    texts, finishes, took = asyncio.run(under_kill())
    print(f"a replacement controller served {took:.1f} s after the kill")
    assert texts == expected
    assert len(finishes) >= PROBE_FOR_S / PROBE_EVERY_S / 2
    assert set(finishes) == {"length"}, finishes
    new = membership()
    assert new.epoch != old.epoch and controller_pid() != pid
    assert engines() == before                       # same actors, each model loaded once
    assert {m.actor_id for m in new.members} == {m.actor_id for m in old.members}
    status, body = health(server)
    assert status == 200, body


def test_deleted_application_stops_its_engines(server: str):
    """Last on this server: it deletes the application."""
    import ray
    from ray import serve
    assert set(ENGINES) <= set(ray.util.list_named_actors())
    began = time.monotonic()
    serve.delete(APP)
    wait_until(lambda: not set(ENGINES) & set(ray.util.list_named_actors()), STOPPED_WITHIN_S,
               0.5, "no engine actor of the deleted application")
    print(f"engines gone {time.monotonic() - began:.1f} s after `serve delete` began")
