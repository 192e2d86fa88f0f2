"""Router overhead: the HTTP round trip of a 1-token completion vs the same engine replicas
called directly, interleaved on one deployment; prints JSON (and writes it with -o).

    python -m bench.router_overhead [--config configs/pd.yaml] [--requests 200]
        [--set mode=colocated] [--set engine.dtype=bfloat16] [--max-seconds 170]
        [--ingress haproxy|proxy] [--http-port PORT] [--tracing-ab] [-o out.json]

One Serve application is deployed (`build_app(args)` on a free loopback port, which stands
for the shipped port 8000: HAProxy listens there, or with --ingress proxy Serve's Python
proxy, as before HAProxy was the default). Its router
replica owns the engine replicas; the driver borrows a copy of the replica's EngineClient
(the same actor handles) and calls `generate` itself. After warm-up, each round times, in
rotating order so no path always follows the same one:

    http     POST /v1/completions, max_tokens=1, over one keep-alive connection
    direct   EngineClient.generate with the same token ids and sampling params; also timed
             to its first output (direct_first: disaggregated, the prefill side's answer)
    health   GET /health: the Serve floor (proxy → router replica → FastAPI, no engine)
    ping     one actor call to the decode replica (`load`): the Ray round trip
    http_traced  (--tracing-ab) the http request with request tracing on (router/tracing.py:
             every span built and written to a span file); `http` is then the same request
             with it off. The app runs with `tracing:` enabled, and the bench switches the
             router replica's tracer off and on around this path (an actor call, untimed), so
             that off and on are interleaved on one deployment; off is exactly the disabled
             config's path (no tracer: `OpenAIServing.tracing` None)

Requests are sequential, so differences are per-request costs, not queueing. Both paths see
the same replicas, caches and machine noise; the paired difference (http − direct of one
round) also cancels slow drifts. The run keeps to --max-seconds, start-up included: the
deployment may take what is left of it, and rounds stop early when it runs out (the report
says how many were done); each request has --request-timeout. A watchdog past that budget
dumps every thread's stack and exits. RAY_SERVE_* variables in the environment reach the
local Ray cluster the bench starts (they are recorded in the report); --ingress sets
RAY_SERVE_ENABLE_HA_PROXY for it (with --address, the cluster's own environment decides).
"""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import http.client
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve

from bench.harness.serving_runs import get_text, set_args
from bench.serving_bench import APP, borrow_client, free_port, ingress_env, replica_serving
from bench.tracing_cost import off_path_us
from pd_cluster.request import FinishReason
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tokenizer import load_tokenizer
from router.app import build_app
from router.app_config import AppConfig
from router.control.model import model_dir
from router.routing import RoutingInputs, make_policy
from router.tracing import EXPORT_EVERY_MS

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "The capital of France is"
PATHS = ("http", "direct", "health", "ping")
SERIES = ("http", "direct", "direct_first", "health", "ping")
TRACED = "http_traced"
WARMUP_ROUNDS = 5
GC_EVERY = 20           # rounds between explicit collections (outside the timed requests)
SHUTDOWN_S = 15         # kept from --max-seconds for stopping Serve and Ray
WATCHDOG_GRACE_S = 60   # past the budget (and one request timeout): dump stacks and exit


def _rank(ms: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted values."""
    return ms[min(len(ms) - 1, max(0, math.ceil(q * len(ms)) - 1))]


def summary(samples_s: list[float]) -> dict[str, float | int | None]:
    ms = sorted(1000 * s for s in samples_s)
    if not ms:
        return {"n": 0, "p50_ms": None}
    stats = {"p50_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
             "p10_ms": _rank(ms, 0.1), "p90_ms": _rank(ms, 0.9), "p99_ms": _rank(ms, 0.99),
             "min_ms": ms[0], "max_ms": ms[-1]}
    return {"n": len(ms), **{k: round(v, 3) for k, v in stats.items()}}


def overhead(http: list[float], direct: list[float]) -> dict[str, float | None]:
    """http − direct in ms: of the p50s and of the means; the paired differences (one round's
    http − direct) by median, p10 and p90."""
    if not http or not direct:
        return {"p50": None, "paired_median": None, "mean": None}
    paired = sorted(1000 * (h - d) for h, d in zip(http, direct))
    stats = {"p50": 1000 * (statistics.median(http) - statistics.median(direct)),
             "paired_median": statistics.median(paired), "paired_p10": _rank(paired, 0.1),
             "paired_p90": _rank(paired, 0.9),
             "mean": 1000 * (statistics.fmean(http) - statistics.fmean(direct))}
    return {k: round(v, 3) for k, v in stats.items()}


def deploy(args: dict[str, Any], port: int, timeout_s: float) -> None:
    """Deploy the app without blocking, then wait for RUNNING (raise on failure or timeout)."""
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run_many([serve.RunTarget(build_app(args), name=APP, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False,
                   wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(APP)
        status = str(app.status) if app else "NOT_STARTED"
        # RUNNING comes once the router replica is constructed; it serves (and has a client
        # to borrow) once its engines are up: /health says 200 then.
        if status.endswith("RUNNING") and get_text(f"http://127.0.0.1:{port}/health", 5.0):
            return
        if status.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            raise RuntimeError(f"the app failed to deploy: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app is not running after {timeout_s:g} s ({status})")
        time.sleep(1)


class HTTPPath:
    """Timed requests over one keep-alive connection (the standard library's client, so no
    third-party HTTP stack is in the timing); a connection the server dropped is reopened
    and the request repeated, untimed until it succeeds."""

    def __init__(self, port: int, body: dict[str, Any], timeout_s: float) -> None:
        self.port, self.timeout_s = port, timeout_s
        self.payload = json.dumps(body)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)

    def _request(self, method: str, path: str) -> None:
        body = self.payload if method == "POST" else None
        self.conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {path}: {data[:500]!r}")

    def timed(self, method: str, path: str) -> float:
        for _ in range(2):
            start = time.perf_counter()
            try:
                self._request(method, path)
                return time.perf_counter() - start
            except (http.client.RemoteDisconnected, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                       timeout=self.timeout_s)
        raise RuntimeError(f"the router dropped the connection twice on {path}")

    def close(self) -> None:
        self.conn.close()


class DirectPath:
    """Timed EngineClient.generate calls, routed as the router would, each bounded."""

    def __init__(self, client: Any, config: AppConfig, ids: list[int], timeout_s: float):
        self.client, self.ids, self.timeout_s = client, ids, timeout_s
        self.policy = make_policy(config.routing.policy, RoutingInputs(
            config.num_prefill, config.num_decode, config.engine.block_size,
            config.routing.prefill_weight, config.conditional_disagg_threshold))
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self.ping_actor = (getattr(client, "decode", None) or client.actors)[0]
        self.count = 0

    async def _generate(self, start: float) -> dict[str, float]:
        self.count += 1
        stream = self.client.generate(f"direct-{self.count}", self.ids, self.params,
                                      self.policy.route(self.ids))
        first = None
        try:
            async for out in stream:
                first = first or time.perf_counter() - start
                if out.finished and out.outputs[0].finish_reason is FinishReason.ERROR:
                    raise RuntimeError(f"the engine failed the request: {out.error}")
        finally:
            await stream.aclose()
        return {"direct": time.perf_counter() - start, "direct_first": first}

    async def timed(self) -> dict[str, float]:
        """The whole request, and its first output (disaggregated: the prefill side's)."""
        return await asyncio.wait_for(self._generate(time.perf_counter()), self.timeout_s)

    async def ping(self) -> dict[str, float]:
        start = time.perf_counter()
        await asyncio.wait_for(self.ping_actor.load.remote(), self.timeout_s)
        return {"ping": time.perf_counter() - start}


def _set_tracing(replica: Any, on: bool) -> bool:
    """Runs in the router replica: its tracer on (the one the config made) or off (None, as
    with tracing disabled); True if it has one to turn on."""
    serving = replica_serving(replica)
    if not hasattr(serving, "bench_tracer"):
        serving.bench_tracer = serving.tracing
    serving.tracing = serving.bench_tracer if on else None
    return serving.bench_tracer is not None


class TracedPath:
    """The http request with the router replica's tracing switched on for it alone."""

    def __init__(self, http_path: HTTPPath, timeout_s: float) -> None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"SERVE_REPLICA::{APP}#OpenAIRouter#")]
        self.replica = ray.get_actor(names[0], namespace="serve")
        self.http_path, self.timeout_s = http_path, timeout_s
        if not self._switch(False):
            raise RuntimeError("--tracing-ab: the router replica has no tracer")

    def _switch(self, on: bool) -> bool:
        return ray.get(self.replica.__ray_call__.remote(_set_tracing, on),
                       timeout=self.timeout_s)

    def timed(self) -> dict[str, float]:
        self._switch(True)
        try:
            return {TRACED: self.http_path.timed("POST", "/v1/completions")}
        finally:
            self._switch(False)


async def measure(http_path: HTTPPath, direct: DirectPath, rounds: int,
                  deadline: float, traced: TracedPath | None = None
                  ) -> tuple[dict[str, list[float]], float]:
    """Warm-up, then up to `rounds` rounds of every path in rotating order, until the
    monotonic `deadline`. Returns the samples per series and the measuring time."""
    timers: dict[str, Callable[[], Any]] = {
        "http": lambda: {"http": http_path.timed("POST", "/v1/completions")},
        "direct": direct.timed,
        "health": lambda: {"health": http_path.timed("GET", "/health")},
        "ping": direct.ping,
    }
    paths = PATHS
    if traced is not None:
        timers[TRACED], paths = traced.timed, (*PATHS, TRACED)

    async def run(name: str) -> dict[str, float]:
        result = timers[name]()
        return await result if asyncio.iscoroutine(result) else result

    for _ in range(WARMUP_ROUNDS):
        for name in paths:
            await run(name)
    samples: dict[str, list[float]] = {name: [] for name in (*SERIES, *paths)}
    gc.collect()
    gc.disable()   # collections come between rounds, not inside a timed request
    start = time.monotonic()
    try:
        for i in range(rounds):
            if time.monotonic() > deadline:
                break
            order = paths[i % len(paths):] + paths[:i % len(paths)]
            for name in order:
                for series, seconds in (await run(name)).items():
                    samples[series].append(seconds)
            if i % GC_EVERY == GC_EVERY - 1:
                gc.collect()
    finally:
        gc.enable()
    return samples, time.monotonic() - start


def tracing_report(samples: dict[str, list[float]], spans_file: Path) -> dict[str, Any]:
    """On against off: the traced request's series, its overhead over direct, the paired
    difference on − off of each round, the spans written, and the off path's own cost."""
    spans = spans_file.read_text().splitlines() if spans_file.exists() else []
    return {TRACED: summary(samples[TRACED]),
            "overhead_traced_ms": overhead(samples[TRACED], samples["direct"]),
            "tracing_cost_ms": overhead(samples[TRACED], samples["http"]),
            "spans_written": len(spans),
            "traces_written": len({json.loads(s)["trace_id"] for s in spans}),
            "off_path_us": off_path_us()}


def run_bench(args: dict[str, Any], opts: argparse.Namespace, deadline: float
              ) -> dict[str, Any]:
    spans_file = Path(f"/tmp/pd-router-overhead-spans-{os.getpid()}.jsonl")
    if opts.tracing_ab:     # the app's tracer, switched per request by TracedPath
        args = {**args, "tracing": {"enabled": True, "file": str(spans_file)}}
    config = AppConfig.from_args(args)
    port = free_port()
    t0 = time.monotonic()
    deploy(args, port, deadline - t0)
    started_s = time.monotonic() - t0
    client = borrow_client(opts.request_timeout)
    ids = load_tokenizer(model_dir(config)).encode(PROMPT)
    body = {"model": config.engine.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    http_path = HTTPPath(opts.http_port or port, body, opts.request_timeout)
    traced = TracedPath(http_path, opts.request_timeout) if opts.tracing_ab else None
    try:
        samples, measured_s = asyncio.run(measure(
            http_path, DirectPath(client, config, ids, opts.request_timeout),
            opts.requests, deadline, traced))
    finally:
        http_path.close()
    rounds = len(samples["http"])
    report = {"requests": opts.requests, "rounds": rounds, "complete": rounds == opts.requests,
              "http_target": f"port {opts.http_port}" if opts.http_port else
              {"haproxy": "haproxy", "proxy": "serve proxy"}[opts.ingress],
              "ingress": opts.ingress,
              "serve_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")},
              "prompt_tokens": len(ids), "start_s": round(started_s, 1),
              "measure_s": round(measured_s, 1),
              **{name: summary(samples[name]) for name in SERIES},
              "overhead_ms": overhead(samples["http"], samples["direct"])}
    if traced is not None:
        time.sleep(2 * EXPORT_EVERY_MS / 1000)      # the last spans' batch
        report["tracing"] = tracing_report(samples, spans_file)
        spans_file.unlink(missing_ok=True)
    if opts.raw:
        report["samples_ms"] = {k: [round(1000 * s, 3) for s in v] for k, v in samples.items()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "pd.yaml"))
    parser.add_argument("--requests", type=int, default=200, help="measured rounds")
    parser.add_argument("--max-seconds", type=float, default=170.0,
                        help="budget of the whole run, start-up included")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy",
                        help="what serves the HTTP port: HAProxy (shipped) or Serve's Python "
                             "proxy (for comparison)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="send HTTP here instead of to the HTTP port (e.g. the router "
                             "replica's own port 30000)")
    parser.add_argument("--address", default=None, help="Ray address (default: start one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                        help="override an app arg, e.g. --set mode=colocated; dotted keys "
                             "reach nested ones: --set engine.dtype=bfloat16")
    parser.add_argument("--raw", action="store_true", help="include every sample")
    parser.add_argument("--tracing-ab", action="store_true",
                        help="also time the http request with request tracing on, "
                             "interleaved with it off (see http_traced above)")
    parser.add_argument("-o", "--output", default=None, help="also write the JSON here")
    opts = parser.parse_args()
    args = set_args(yaml.safe_load(Path(opts.config).read_text())["applications"][0]["args"],
                    opts.set)
    deadline = time.monotonic() + opts.max_seconds - SHUTDOWN_S
    # Past the budget, one request timeout and a grace, something hangs: show where, stop.
    faulthandler.dump_traceback_later(opts.max_seconds + opts.request_timeout
                                      + WATCHDOG_GRACE_S, exit=True)
    if not opts.address:       # Serve reads them when Ray starts
        os.environ.update(ingress_env(opts.ingress == "haproxy"))
    ray.init(address=opts.address or "local", namespace="serve", log_to_driver=False)
    try:
        report = run_bench(args, opts, deadline)
    finally:
        if opts.address:
            serve.delete(APP)          # leave a shared cluster as it was
        ray.shutdown()
    faulthandler.cancel_dump_traceback_later()
    config = Path(opts.config).resolve()
    shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
    text = json.dumps({"config": str(shown), "args": args, **report}, indent=2)
    if opts.output:
        Path(opts.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
