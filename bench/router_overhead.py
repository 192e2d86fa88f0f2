"""Router overhead: HTTP round trip of a 1-token completion vs the engine replicas called
directly through the same EngineClient, on the same Ray cluster; prints JSON.

    python bench/router_overhead.py [--config configs/pd.yaml] [--requests 50]
                                    [--set mode=colocated] [--address auto]

Phase 1 starts the app's engine replicas from this driver (`router.app.start_client`) and
times `EngineClient.generate` with max_tokens=1. Phase 2 releases them and deploys the
whole application (`serve.run(build_app(args))`) on a free loopback port, then times POST
/v1/completions with max_tokens=1 over one keep-alive connection. Requests are sequential,
after warm-up, so the difference is the router's per-request cost (HTTP proxy, Serve handle,
JSON, tokenization, routing, response), not queueing.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pd_cluster.sampling_params import SamplingParams  # noqa: E402
from pd_cluster.tokenizer import load_tokenizer  # noqa: E402
from router.app import (build_app, context_length, engine_config, model_dir,  # noqa: E402
                        start_client)
from router.app_config import AppConfig, replica_actor_options  # noqa: E402
from router.routing import RoutingInputs, make_policy  # noqa: E402

PROMPT = "The capital of France is"
WARMUP = 5
READY_TIMEOUT_S = 900.0


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in samples_s)
    return {"mean_ms": statistics.fmean(ms), "p50_ms": ms[len(ms) // 2],
            "p90_ms": ms[int(0.9 * (len(ms) - 1))], "min_ms": ms[0], "n": len(ms)}


async def time_direct(args: dict[str, Any], n: int) -> list[float]:
    config = AppConfig.from_args(args)
    resources = ray.cluster_resources()
    options = {role: replica_actor_options(config, role, resources)
               for role in ("prefill", "decode")}
    path = model_dir(config)
    ids = load_tokenizer(path).encode(PROMPT)
    client = start_client(config, engine_config(config, context_length(config, path)), options)
    await client.wait_ready(READY_TIMEOUT_S)
    policy = make_policy(config.routing.policy, RoutingInputs(
        config.num_prefill, config.num_decode, config.block_size, config.routing.prefill_weight,
        config.conditional_disagg_threshold))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    samples = []
    for i in range(WARMUP + n):
        start = time.perf_counter()
        async for _ in client.generate(f"direct-{i}", ids, params, policy.route(ids)):
            pass
        samples.append(time.perf_counter() - start)
    return samples[WARMUP:]


def time_http(args: dict[str, Any], n: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="pd", route_prefix="/")
    body = {"model": args.get("model", "default"), "prompt": PROMPT, "max_tokens": 1,
            "temperature": 0}
    samples = []
    # The standard library's keep-alive client: no third-party HTTP stack in the timing.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    payload = json.dumps(body)
    for _ in range(WARMUP + n):
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from the router")
        samples.append(time.perf_counter() - start)
    conn.close()
    serve.shutdown()
    return samples[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "pd.yaml"))
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--address", default=None, help="Ray address (default: start one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                        help="override an app arg, e.g. --set mode=colocated")
    opts = parser.parse_args()
    args = yaml.safe_load(Path(opts.config).read_text())["applications"][0]["args"]
    for item in opts.set:
        key, value = item.split("=", 1)
        args[key] = yaml.safe_load(value)
    args.pop("api_key_env", None)          # the bench talks to its own app, without a key
    ray.init(address=opts.address or "local", namespace="serve", log_to_driver=False)
    try:
        direct = asyncio.run(time_direct(args, opts.requests))
        gc.collect()                      # release the phase-1 replicas (owned by this driver)
        time.sleep(5)
        http = time_http(args, opts.requests)
    finally:
        ray.shutdown()
    d, h = summary(direct), summary(http)
    config = Path(opts.config).resolve()
    shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config
    print(json.dumps({"config": str(shown), "args": args, "direct": d, "http": h,
                      "overhead_ms": {"mean": h["mean_ms"] - d["mean_ms"],
                                      "p50": h["p50_ms"] - d["p50_ms"]}}, indent=2))


if __name__ == "__main__":
    main()
