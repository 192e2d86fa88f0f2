"""Where a disaggregated request's time goes under load: open-loop Poisson arrivals into the
actors (no HTTP), then each stage from the actors' own stamps. Prints one JSON object.

    python bench/disagg_probe.py --rate 12 --seconds 15 [--prompt-len 2048] [--new-tokens 256]

Stages per request (medians, p90, max over the requests sent; same-host monotonic clocks):
queue+prefill (P called → first token computed), destination (→ D's reservation known),
transfer (→ every write landed, as P sees it), handoff (→ D's decode called), landing
(→ D sees the KV landed), first output (→ the client has the first token; negative when
the router streams P's first token before D resumes), and the TTFT.
Also P's per-layer lag between a layer's compute and its write being posted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.models import dummy_model_dir  # noqa: E402
from bench.pd_bench import VOCAB, prompt, start_engines  # noqa: E402
from pd_cluster.benchmark.diagnostics import stage_stats as _stats  # noqa: E402
from pd_cluster.config import ModelConfig  # noqa: E402
from pd_cluster.sampling_params import SamplingParams  # noqa: E402
from router.routing import Route  # noqa: E402


async def _load(client, rate: float, seconds: float, prompt_len: int, new_tokens: int,
                timeout_s: float) -> dict[str, dict]:
    rng, sent = random.Random(int(rate * 1000)), {}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    async def one(rid: str) -> None:
        rec = sent[rid] = {"sent": time.monotonic()}
        try:
            async for _ in client.generate(rid, prompt(prompt_len), params, Route(0, 0)):
                rec.setdefault("first", time.monotonic())
            rec["done"] = time.monotonic()
        except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
            rec["error"] = repr(e)[:200]

    tasks, end, i = [], time.monotonic() + seconds, 0
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(one(f"probe-{rate:g}-{i}")))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.wait(tasks, timeout=timeout_s)
    return sent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="12", help="requests/s; several: 8,12")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--model", default=None, help="config-only model dir (default: 8B shape)")
    ap.add_argument("--gpus-per-actor", type=float, default=1, help="0 for a CPU smoke run")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    model = args.model or dummy_model_dir()
    VOCAB[0] = ModelConfig.from_dir(model).vocab_size
    ray.init(log_to_driver=False)
    client = start_engines("disaggregated", model, "bfloat16" if args.gpus_per_actor
                           else "float32", args.transport, args.gpus_per_actor, 2048)

    async def go() -> dict:
        await client.wait_ready(600)
        await _load(client, 2.0, 2.0, args.prompt_len, 8, args.timeout)   # warm-up
        out = {}
        for rate in [float(r) for r in args.rate.split(",")]:
            sent = await _load(client, rate, args.seconds, args.prompt_len, args.new_tokens,
                               args.timeout)
            p_stages = {r[0]: r[1:] for r in await client.prefill[0].stage_times.remote()}
            d_stages = {r[0]: r[1:] for r in await client.decode[0].stage_times.remote()}
            marks = await client.prefill[0].timeline.remote()
            out[f"{rate:g}"] = _report(sent, p_stages, d_stages, marks)
        return out

    try:
        res = asyncio.run(go())
    finally:
        for a in client.prefill + client.decode:
            ray.kill(a)
    res = {"by_rate": res, "seconds": args.seconds, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "transport": args.transport}
    print(json.dumps(res, indent=1))


def _report(sent: dict, p: dict, d: dict, marks: list) -> dict:
    stages = {k: [] for k in ("queue_prefill", "destination", "transfer", "handoff", "landing",
                              "first_output", "ttft")}
    for rid, rec in sent.items():
        if "first" in rec:
            stages["ttft"].append(rec["first"] - rec["sent"])
        # Stage rows are keyed by the attempt id: the request id, then "id#1", ... on re-runs.
        prow = p.get(rid) or next((v for k, v in p.items() if k.startswith(rid + "#")), None)
        drow = d.get(rid) or next((v for k, v in d.items() if k.startswith(rid + "#")), None)
        if prow:
            called, prefilled, dest, landed = prow
            stages["queue_prefill"].append(prefilled - called)
            stages["destination"].append(max(0.0, dest - prefilled))
            stages["transfer"].append(landed - dest)
            if drow:
                stages["handoff"].append(drow[0] - landed)
                stages["landing"].append(drow[1] - drow[0])
                if "first" in rec:
                    stages["first_output"].append(rec["first"] - drow[1])
    computed: dict[int, list[float]] = {}
    lags = []
    for what, layer, t in marks:
        if what == "computed":
            computed.setdefault(layer, []).append(t)
        elif computed.get(layer):
            lags.append(t - computed[layer].pop(0))
    errors = [rec["error"] for rec in sent.values() if "error" in rec]
    return {"sent": len(sent), "completed": sum("done" in r for r in sent.values()),
            "errors": errors[:5], "num_errors": len(errors),
            "stages": {k: _stats(v) for k, v in stages.items()},
            "layer_post_lag": _stats(lags)}


if __name__ == "__main__":
    main()
