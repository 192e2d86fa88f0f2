"""The control plane through the real `serve run configs/pd.yaml`: two router replicas over one
set of 1 prefill + 2 decode engines (three engine actors, owned by the EngineController), driven
through HAProxy with plain HTTP streams and the `openai` client, with `tracing:` on. One server
for every test below, each leaving it serving for the next (starting one takes most of a
minute on 2 cores):

- 64 concurrent streams are spread over both routers (each answer names its router replica in
  the `x-pd-router` header), and a prompt sharing a prefix with one served by the other router
  reports cached tokens;
- SIGKILL of a decode engine's process under load: its streams go on on the other decoder with
  the exact tokens, none fails, and the controller brings the decode tier back to 2 decoders;
- SIGKILL of a router replica's process under load: the other router's streams end with the
  exact tokens, every request sent from PROBES_FROM_S after the kill (one every PROBE_EVERY_S)
  succeeds, every KV block of the killed router's requests is freed on P and D, and a
  replacement router serves within REPLACED_WITHIN_S over the same engine actors;
- SIGKILL of the engine controller's process while 16 streams run: every stream ends with the
  exact greedy text, every request sent after the kill succeeds, and a replacement
  controller adopts the same named engine actors (same ids, each model loaded once, a new
  membership epoch) within ADOPTED_WITHIN_S (router/control/controller.py);
- a drained decoder is retired and the rest serve, /health saying "degraded";
- one trace per request (router/tracing.py, issue 48), exported over the real OTLP/HTTP
  exporter to a collector in this test and to a span file, which `pd-cluster trace` turns into
  Perfetto's JSON; per-transfer metrics (router/transfer_metrics.py);
- `serve delete` of the application stops its detached engines within STOPPED_WITHIN_S (the
  controller's graceful stop kills them, well before their leases would lapse).
(An engine replica that cannot be placed: tests/router/control/test_unplaceable.py. An engine
whose lease lapses stops itself: tests/actors/test_engine_lease.py.)
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

from pd_cluster.cli import main as cli_main

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from actors.engine_lease import ENGINE_LEASE_S  # noqa: E402
from router.control.controller import STOP_WITHIN_S  # noqa: E402
from tests.support.serve_run import health, serve_run  # noqa: E402
from tests.support.serve_tracing import (  # noqa: E402
    CHAIN, P_STAGES, SCHEMA, SPANS_WITHIN_S, check_trace, collecting, metrics_by_router,
    traced_request)
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
APP = "pd"
# Requests go on, one every PROBE_EVERY_S, from the controller's kill until this long after a
# replacement serves: the window without a controller, and the routers' re-sync to its epoch.
PROBES_AFTER_ADOPTION_S = 3.0
# Serve's health check of the controller (2 s), a new replica process importing Ray Serve
# on 2 cores busy with the streams, the adoption: well within the engines' lease, which a
# replacement must renew before it lapses.
ADOPTED_WITHIN_S = ENGINE_LEASE_S
# The controller's graceful stop kills them (a lapsed lease would take ENGINE_LEASE_S).
STOPPED_WITHIN_S = STOP_WITHIN_S + 10.0


@pytest.fixture(scope="module")
def traces():
    """The collector, span file and `tracing` args the server exports its traces to."""
    with collecting("pd-test") as (collector, spans_file, tracing):
        yield collector, spans_file, tracing


@pytest.fixture(scope="module")
def server(traces):
    """The module's one application, for every test in the order they are written: each
    leaves it serving, the last deletes it."""
    with serve_run({**ARGS, "tracing": traces[2]}, num_cpus=NUM_CPUS) as url:
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


def client_of(url: str):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                              timeout=300)


async def openai_stream(client, i: int, started: asyncio.Event) -> str:
    """Prompt i's greedy text at LONG tokens, streamed through the `openai` client."""
    text = ""
    chunks = await client.completions.create(model="default", prompt=prompt(i),
                                             max_tokens=LONG, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    async for chunk in chunks:
        text += chunk.choices[0].text if chunk.choices else ""
        if text:
            started.set()
    return text


def controller_pid() -> int:
    from ray._private.state import actors
    alive = [a for a in actors().values() if a["State"] == "ALIVE"
             and "EngineController" in a["ActorClassName"]]
    assert len(alive) == 1, alive
    return alive[0]["Pid"]


def app_engines() -> dict[str, tuple[str, int]]:
    """Name → (actor id, model loads) of the application's engine actors (named
    "pd-<app>-<role>-<id>", a restarted one's with a suffix: router/control/engines.py)."""
    import ray
    out = {}
    for name in ray.util.list_named_actors():
        if name.startswith(f"pd-{APP}-"):
            actor = ray.get_actor(name)
            out[name] = (actor._actor_id.hex(),
                         ray.get(actor.load.remote(), timeout=30).model_loads)
    return out


def controller_membership():
    from ray import serve
    handle = serve.get_deployment_handle("EngineController", app_name=APP)
    return handle.membership.remote(-1, 0.0).result(timeout_s=5)


def test_controller_killed_under_load_engines_adopted_and_no_request_fails(
        server: str, expected: list[str]):
    before, old = app_engines(), controller_membership()
    assert len(before) == 3 and all(loads == 1 for _, loads in before.values()), before
    pid = controller_pid()

    async def adoption(killed: float) -> float:
        """Seconds from the kill until a replacement controller serves a new epoch."""
        while True:
            try:
                m = await asyncio.wait_for(asyncio.to_thread(controller_membership), 10)
                if m.epoch != old.epoch and m.serving():
                    return time.monotonic() - killed
            except Exception:  # noqa: BLE001 - no controller replica yet
                pass
            await asyncio.sleep(0.5)

    async def under_kill() -> tuple[list, list, float]:
        events = [asyncio.Event() for _ in expected]
        async with client_of(server) as client:
            streams = [asyncio.ensure_future(openai_stream(client, i, events[i]))
                       for i in range(len(expected))]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in events]), 120)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            adopted = asyncio.ensure_future(asyncio.wait_for(adoption(killed),
                                                             ADOPTED_WITHIN_S))
            probes, adopted_at = [], None
            while adopted_at is None or time.monotonic() - adopted_at < PROBES_AFTER_ADOPTION_S:
                probes.append(asyncio.ensure_future(client.completions.create(
                    model="default", prompt="The capital of France is", max_tokens=4,
                    temperature=0)))
                await asyncio.sleep(PROBE_EVERY_S)
                if adopted_at is None and adopted.done():
                    adopted_at = time.monotonic()
            answers = await asyncio.gather(*probes, return_exceptions=True)
            texts = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True),
                                           300)
            took = await adopted
        return texts, [a if isinstance(a, Exception) else a.choices[0].finish_reason
                       for a in answers], took
    texts, finishes, took = asyncio.run(under_kill())
    print(f"a replacement controller served {took:.1f} s after the kill")
    assert texts == expected
    assert len(finishes) >= (took + PROBES_AFTER_ADOPTION_S) / PROBE_EVERY_S / 2
    assert set(finishes) == {"length"}, finishes
    new = controller_membership()
    assert new.epoch != old.epoch and controller_pid() != pid
    assert app_engines() == before                   # same actors, each model loaded once
    assert {m.actor_id for m in new.members} == {m.actor_id for m in old.members}
    status, body = health(server)
    assert status == 200, body


def test_drained_decoder_is_retired_and_the_rest_serve(server: str):
    """It leaves one decoder (the trace test below counts on it)."""
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


@pytest.mark.timeout(900)
def test_one_trace_per_request(server: str, traces, tmp_path):
    """After the drain: decode-0 is the only decoder, so every trace's D stages run there."""
    collector, spans_file, _ = traces
    plain = traced_request(server, "/v1/completions", {
        "model": "default", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    grammar = traced_request(server, "/v1/chat/completions", {   # streamed: the SSE path's
        "model": "default", "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": SCHEMA}}})
    short = {"model": "default", "prompt": "Hello", "max_tokens": 2}
    unsampled = traced_request(server, "/v1/completions", short, flags="00")  # the client's
    untraced = traced_request(server, "/v1/completions", short, flags=None)   # ratio 1
    # + grammar.compile in the router, on P and on D (each builds its own matcher)
    wanted = {plain[0]: len(CHAIN) + len(P_STAGES), grammar[0]: len(CHAIN) + len(P_STAGES) + 3}
    spans_of = collector.spans_of
    wait_until(lambda: all(len(spans_of(t)) >= n + 1 for t, n in wanted.items()),
               SPANS_WITHIN_S, 0.2, "every span of both traces at the collector")
    wait_until(lambda: collector.roots_of(untraced[2]["id"]), SPANS_WITHIN_S, 0.2,
               "a trace of its own")
    assert len(collector.roots_of(untraced[2]["id"])) == 1
    assert not spans_of(unsampled[0])       # exported with those, had it been sampled
    figures = {}
    for (trace_id, client_span, body, latency) in (plain, grammar):
        figures[trace_id] = check_trace(spans_of(trace_id), client_span, body["usage"],
                                        latency)
    spans = spans_of(grammar[0])
    compiles = {s["attrs"]["pd.process"]: s for s in spans if s["name"] == "grammar.compile"}
    parents = {s["name"]: s["span_id"] for s in spans
               if s["name"] in ("router.preprocess", "prefill")}
    root = next(s for s in spans if s["parent_id"] == grammar[1])
    assert set(compiles) == {"router", "prefill-0", "decode-0"}
    assert compiles["router"]["parent_id"] == parents["router.preprocess"]
    assert compiles["prefill-0"]["parent_id"] == parents["prefill"]
    assert compiles["decode-0"]["parent_id"] == root["span_id"]
    print("trace figures:", json.dumps(figures))

    # Per-transfer metrics: both requests' handovers, labelled by transport and pair (each
    # router replica counts those it served).
    by_router = metrics_by_router(server, ARGS["router_replicas"])
    counts: dict[tuple, float] = {}
    for m in by_router.values():
        for s in m["pd_kv_transfer_duration_seconds"]:
            if s.name.endswith("_count"):
                key = tuple(sorted(s.labels.items()))
                counts[key] = counts.get(key, 0) + s.value
        assert "pd_kv_transfer_size_bytes" in m and "pd_kv_transfer_failures" in m
    assert counts[(("pair", "p0-d0"), ("transport", "nixl"))] >= 2, counts

    # The span file holds the same spans; `pd-cluster trace` makes Perfetto's JSON of them.
    wait_until(lambda: spans_file.exists() and plain[0] in spans_file.read_text(),
               SPANS_WITHIN_S, 0.2, "the span file")
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(spans_file), "-o", str(out), "--trace-id", plain[0]]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= set(CHAIN + P_STAGES)
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {"router", "prefill-0", "decode-0"}
    png = os.environ.get("PD_TRACE_PNG")     # docs/: `PD_TRACE_PNG=docs/trace.png pytest ...`
    if png:
        from pd_cluster.trace_events import load_spans, render_png
        render_png(load_spans(spans_file), png, grammar[0])


def test_deleted_application_stops_its_engines(server: str):
    """Last on this server: it deletes the application."""
    import ray
    from ray import serve
    engines = set(app_engines())
    assert len(engines) >= 2, engines
    began = time.monotonic()
    serve.delete(APP)
    wait_until(lambda: not engines & set(ray.util.list_named_actors()), STOPPED_WITHIN_S,
               0.5, "no engine actor of the deleted application")
    print(f"engines gone {time.monotonic() - began:.1f} s after `serve delete` began")
