"""The control plane through the real `serve run configs/pd.yaml`: two router replicas over one
set of 1 prefill + 2 decode engines (three engine actors, owned by the EngineController), driven
through HAProxy with plain HTTP streams.

- 64 concurrent streams are spread over both routers (each answer names its router replica in
  the `x-pd-router` header), and a prompt sharing a prefix with one served by the other router
  reports cached tokens;
- SIGKILL of a decode engine's process under load: its streams go on on the other decoder with
  the exact tokens, none fails, and the controller brings the decode tier back to 2 decoders;
- SIGKILL of a router replica's process under load: the other router's streams end with the
  exact tokens, every request sent from PROBES_FROM_S after the kill (one every PROBE_EVERY_S)
  succeeds, every KV block of the killed router's requests is freed on P and D, and a
  replacement router serves within REPLACED_WITHIN_S over the same engine actors;
- a drained decoder is retired and the rest serve, /health saying "degraded".
(An engine replica that cannot be placed: tests/router/control/test_unplaceable.py.)
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray")
from tests.support.serve_run import health, serve_run  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.serve, pytest.mark.slow]
ROUTER_HEADER = "x-pd-router"
ARGS = {"mode": "disaggregated", "num_prefill": 1, "num_decode": 2, "router_replicas": 2,
        "routing": {"policy": "kv_aware"}}
# 5 logical CPUs for 2 routers and 3 engines: Ray's accounting only; the machine has 2 cores.
NUM_CPUS = 5
REPORTED_WITHIN_S = 2.5          # two load polls (LOAD_POLL_S) of every router
LONG = 48                        # tokens of a stream that must outlive a kill
# Serve notices the dead replica at its next health check (2 s) and starts one whose process
# imports torch and Ray Serve while the survivors' streams load both cores.
REPLACED_WITHIN_S = 60.0
PROBE_EVERY_S = 0.5              # new requests through the ingress after a router's kill
PROBES_FROM_S = 1.0              # the first of them, after the kill
FREED_WITHIN_S = 40.0            # subscriber lease (10 s) and reservation leases, with margin
RESTORED_WITHIN_S = 120.0        # a new decoder loads the model on busy cores


@pytest.fixture(scope="module")
def server():
    with serve_run(ARGS, num_cpus=NUM_CPUS) as url:
        yield url


def prompt(i: int) -> str:
    return f"Story number {i}: once upon a time, in a land far away, there lived"


async def stream(client: httpx.AsyncClient, url: str, text: str, max_tokens: int,
                 started: asyncio.Event | None = None) -> dict:
    """One streamed completion through HAProxy: its router replica, text, finish reason and
    usage; `error` instead when the stream broke."""
    body = {"model": "default", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    out: dict = {"router": "", "text": "", "finish": "", "usage": None, "error": ""}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            out["router"] = resp.headers.get(ROUTER_HEADER, "")
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    out["text"] += choice.get("text") or ""
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                    if started is not None and out["text"]:
                        started.set()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_streams(url: str, n: int, max_tokens: int, during=None, timeout_s: float = 300) -> list:
    """`n` concurrent streams of prompts 0..n-1; `during(started_events)` runs beside them."""
    async def main():
        events = [asyncio.Event() for _ in range(n)]
        async with httpx.AsyncClient(timeout=timeout_s,
                                     limits=httpx.Limits(max_connections=n + 8)) as client:
            tasks = [stream(client, url, prompt(i), max_tokens, events[i]) for i in range(n)]
            if during is not None:
                tasks.append(during(events))
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    results = asyncio.run(main())
    return results[:n]


def routers(url: str, tries: int = 40) -> dict[str, int]:
    """Router replica → its process id, from /health answers (HAProxy spreads them)."""
    seen: dict[str, int] = {}
    for _ in range(tries):
        _, body = health(url)
        if body is not None:
            seen[body["router"]["replica"]] = body["router"]["pid"]
    return seen


def engine_ids(url: str) -> dict[str, str]:
    """Engine replica name → its actor id, from /health."""
    _, body = health(url)
    return {r["replica"]: r["actor_id"] for tier in body["tiers"].values()
            for r in tier["replicas"]}


def engine_metrics(url: str) -> dict[str, list[float]]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    return {name: [s.value for s in families.get(name, []) if s.labels.get("role")]
            for name in ("pd_num_requests_running", "pd_num_requests_waiting",
                         "pd_kv_blocks_used")}


@pytest.fixture(scope="module")
def expected(server: str) -> list[str]:
    """The greedy texts of prompts 0..15 at LONG tokens, before anything is killed."""
    results = run_streams(server, 16, LONG)
    assert all(r["finish"] == "length" and not r["error"] for r in results), results
    return [r["text"] for r in results]


def test_64_streams_spread_over_both_routers_and_share_one_prefix_cache(server: str):
    results = run_streams(server, 64, 8)
    assert all(r["finish"] == "length" for r in results), [r for r in results if r["error"]]
    by_router = {r["router"] for r in results}
    assert len(by_router) == 2, by_router

    # One long prefix through one router, then the same prefix through the other one, which
    # learns where it is cached from the engines' prefix reports (polled every second).
    prefix = " ".join(f"word{i}" for i in range(120))
    first = asyncio.run(_one(server, prefix + " first"))
    time.sleep(REPORTED_WITHIN_S)
    for i in range(40):
        other = asyncio.run(_one(server, prefix + f" again {i}"))
        if other["router"] != first["router"]:
            break
    assert other["router"] != first["router"], "HAProxy sent 40 requests to one router"
    cached = other["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, other["usage"]


async def _one(url: str, text: str) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        out = await stream(client, url, text, 2)
    assert not out["error"], out
    return out


def test_killed_decoder_streams_finish_exactly_and_the_tier_comes_back(server: str,
                                                                       expected: list[str]):
    from ray._private.state import actors
    before = engine_ids(server)
    victim = actors(actor_id=before["decode-0"])
    assert victim["State"] == "ALIVE" and victim["ActorClassName"] == "EngineActor"

    async def kill_when_streaming(events):
        await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 120)
        os.kill(victim["Pid"], signal.SIGKILL)

    results = run_streams(server, 16, LONG, kill_when_streaming)
    assert [r["error"] for r in results] == [""] * 16
    assert [r["text"] for r in results] == expected

    def restored() -> bool:
        status, body = health(server)
        tier = body["tiers"]["decode"] if body else {}
        return status == 200 and tier.get("ready") == 2 and tier["state"] == "ready"
    wait_until(restored, RESTORED_WITHIN_S, 1.0, "the decode tier back at 2 ready")
    after = engine_ids(server)
    assert after["decode-0"] != before["decode-0"]
    assert after["decode-1"] == before["decode-1"] and after["prefill-0"] == before["prefill-0"]


async def probe(client: httpx.AsyncClient, url: str, sent_after: float) -> dict:
    """One short completion through HAProxy: its router replica and status (0: no answer)."""
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 2}
    try:
        resp = await client.post(f"{url}/v1/completions", json=body)
        return {"router": resp.headers.get(ROUTER_HEADER, ""), "status": resp.status_code,
                "sent_after": sent_after, "body": resp.text[:200]}
    except httpx.HTTPError as e:
        return {"router": "", "status": 0, "sent_after": sent_after, "body": repr(e)}


def test_killed_router_costs_only_its_streams_new_requests_succeed_and_it_is_replaced(
        server: str, expected: list[str]):
    pids = routers(server)
    assert len(pids) == 2, pids
    engines = engine_ids(server)
    victim = sorted(pids)[0]
    killed_at: list[float] = []
    probes: list[dict] = []

    async def kill_when_streaming(events):
        await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 120)
        os.kill(pids[victim], signal.SIGKILL)
        killed_at.append(time.monotonic())
        # New requests every PROBE_EVERY_S until one is answered by the replacement, from
        # PROBES_FROM_S on: one that HAProxy forwards to the process as it dies (seen within
        # 0.1 s of the kill) fails as that replica's own requests do.
        await asyncio.sleep(PROBES_FROM_S)
        async with httpx.AsyncClient(timeout=120) as client:
            sent: list[asyncio.Future] = []
            while time.monotonic() - killed_at[0] < REPLACED_WITHIN_S and not any(
                    t.done() and t.result()["router"] not in pids for t in sent):
                sent.append(asyncio.ensure_future(
                    probe(client, server, time.monotonic() - killed_at[0])))
                await asyncio.sleep(PROBE_EVERY_S)
            probes.extend(await asyncio.gather(*sent))

    results = run_streams(server, 16, LONG, kill_when_streaming)
    # The ingress stops sending to the dead replica at once, and the replacement gets
    # requests only once it serves (router/app.py): no request sent after the kill fails.
    assert [p for p in probes if p["status"] != 200] == []
    by_replacement = [p for p in probes if p["router"] and p["router"] not in pids]
    assert by_replacement, "no request answered by a replacement router"
    print(f"{len(probes)} requests after the kill, none failed; the replacement answered "
          f"one sent {by_replacement[0]['sent_after']:.1f} s after the kill")
    on_victim = [i for i, r in enumerate(results) if r["router"] == victim]
    survivors = [i for i, r in enumerate(results) if r["router"] != victim]
    assert on_victim and survivors, [r["router"] for r in results]
    assert all(not results[i]["error"] for i in survivors)
    assert [results[i]["text"] for i in survivors] == [expected[i] for i in survivors]
    assert all(results[i]["error"] or results[i]["finish"] != "length" for i in on_victim)

    # The replacement (it served a request within REPLACED_WITHIN_S, above) reports healthy.
    def replaced() -> bool:
        status, body = health(server)
        return status == 200 and body["router"]["replica"] == by_replacement[0]["router"]
    wait_until(replaced, 30, 0.2, "the replacement router replica answering /health")
    assert engine_ids(server) == engines        # no engine restarted

    # Every request the killed router left on P and D ends, and its KV is freed.
    def idle() -> dict | None:
        m = engine_metrics(server)
        return None if any(v for values in m.values() for v in values) else m
    wait_until(idle, FREED_WITHIN_S, 0.5, "engines idle with every KV block free")
    assert engine_metrics(server)["pd_kv_blocks_used"] == [0.0, 0.0, 0.0]


def test_drained_decoder_is_retired_and_the_rest_serve(server: str):
    """Last of the module's tests on this server: it leaves one decoder."""
    from ray import serve
    controller = serve.get_deployment_handle("EngineController", app_name="pd")
    membership = controller.drain.remote("decode", 1, 60.0).result(timeout_s=90)
    states = {f"{m.role}-{m.replica_id}": str(m.state) for m in membership.members}
    assert states == {"prefill-0": "ready", "decode-0": "ready", "decode-1": "retired"}

    # A drained replica leaves the tier on purpose: the tier's target shrinks with it.
    def shrunk() -> dict | None:
        status, body = health(server)
        return body if status == 200 and body["tiers"]["decode"]["target"] == 1 else None
    body = wait_until(shrunk, 30, 0.5, "/health: the decode tier's target down to 1")
    assert body["status"] == "ok" and body["tiers"]["decode"]["state"] == "ready"
    results = run_streams(server, 8, 8)
    assert [r["error"] for r in results] == [""] * 8
