"""Disaggregated (1 P + 1 D) against colocated (1 engine), same engine, through the actors.

    python -m bench.pd_bench --transport nixl [--prompt-len 2048] [--batch 128]

Needs two GPUs (one per actor) for the disaggregated half. Prints one JSON object:
- TTFT of a single prompt at low load (fresh random prompt each time, so no prefix hits),
  median over repetitions, and the KV transfer's time as reported by the prefill actor;
- decode throughput at a batch: `batch` requests at once, output tokens per second from the
  moment every request has its first token until all finish.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import ray

from bench.models import dummy_model_dir
from pd_cluster.config import ModelConfig
from pd_cluster.sampling_params import SamplingParams
from router.app import start_client
from router.app_config import AppConfig
from router.routing import Route

rng = random.Random(0)
VOCAB = [128256]  # set from the model in main()


def prompt(n: int) -> list[int]:
    return [rng.randrange(1, VOCAB[0]) for _ in range(n)]


async def ttft(client, route: Route, length: int, reps: int) -> list[float]:
    out = []
    for i in range(reps + 2):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        start = time.perf_counter()
        first = None
        async for _ in client.generate(f"t{i}-{time.time_ns()}", prompt(length), params, route):
            first = first or time.perf_counter()
        if i >= 2:  # two warm-ups
            out.append(first - start)
    return out


async def decode_throughput(client, route: Route, batch: int, prompt_len: int,
                            new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in range(batch)]

    async def one(i: int) -> None:
        async for _ in client.generate(f"d{i}-{time.time_ns()}", prompt(prompt_len), params,
                                       route):
            stamps[i].append(time.perf_counter())

    await asyncio.gather(*[one(i) for i in range(batch)])
    # The window where all `batch` requests are decoding: after the last first token, before
    # the first request ends. Outputs inside it / its length = decode throughput at `batch`.
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    inside = sum(1 for s in stamps for t in s if start < t <= end)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "window_s": end - start, "outputs_in_window": inside,
            "output_tok_s": inside / (end - start) if end > start else None}


def start_engines(mode: str, model: str, dtype: str, transport: str, gpus_per_actor: float,
                  max_num_batched_tokens: int):
    """1 P + 1 D (or one colocated engine) of a dummy model, started from this driver."""
    cfg = AppConfig.from_args({
        "mode": mode, "num_prefill": 1 if mode != "colocated" else 0, "num_decode": 1,
        "transport": transport, "limits": {"max_tokens": 4096},
        "engine": {"model": model, "load_format": "dummy", "dtype": dtype, "max_num_seqs": 256,
                   "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": 4096}})
    opts = {role: {"num_gpus": gpus_per_actor, "num_cpus": 0} for role in ("prefill", "decode")}
    return start_client(cfg, cfg.engine, opts)


def run(mode: str, args) -> dict:
    client = start_engines(mode, args.model or dummy_model_dir(), args.dtype, args.transport,
                           args.gpus_per_actor, 8192)

    async def go() -> dict:
        await client.wait_ready(600)
        route = Route(0, 0 if mode != "colocated" else None)
        t = await ttft(client, route, args.prompt_len, args.reps)
        loads = await client.loads()
        d = await decode_throughput(client, route, args.batch, args.decode_prompt_len,
                                    args.new_tokens)
        return {"ttft_ms": [x * 1e3 for x in t], "ttft_median_ms": statistics.median(t) * 1e3,
                "kv_transfer_s_total": sum(ld.kv_transfer_seconds for ld in loads
                                           if ld.role == "prefill"),
                "kv_bytes_total": sum(ld.kv_bytes_transferred for ld in loads
                                      if ld.role == "prefill"),
                "decode": d}
    try:
        return asyncio.run(go())
    finally:
        for a in getattr(client, "prefill", []) + getattr(client, "decode", []) + \
                getattr(client, "actors", []):
            ray.kill(a)
        time.sleep(3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--model", default=None, help="config-only model dir (default: 8B shape)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpus-per-actor", type=float, default=1, help="0 for a CPU smoke run")
    args = ap.parse_args()
    VOCAB[0] = ModelConfig.from_dir(args.model or dummy_model_dir()).vocab_size
    ray.init(log_to_driver=False)
    res = {"model": "llama-3.1-8b shape, dummy bf16", "transport": args.transport}
    res["disaggregated"] = run("disaggregated", args)
    res["colocated"] = run("colocated", args)
    dis, col = res["disaggregated"], res["colocated"]
    res["ttft_ratio"] = dis["ttft_median_ms"] / col["ttft_median_ms"]
    res["decode_throughput_ratio"] = (dis["decode"]["output_tok_s"]
                                      / col["decode"]["output_tok_s"])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
