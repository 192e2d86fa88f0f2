"""Served against offline throughput on the same engine in the same run: N streamed requests,
C at a time, through HTTP (HAProxy → router replica → engine actor), then the same workload
inside the engine actor itself (`StreamingEngine.run_offline`: no HTTP, no router, no Ray
stream); prints JSON (and writes it with -o).

    python -m bench.served_vs_offline [--set KEY=YAML ...] [--router-replicas N]
        [--requests 256] [--concurrency 128] [--prompt-len 512] [--max-tokens 256]
        [--warmup-requests 8] [--rounds 1] [-o out.json]

The app is configs/pd.yaml's with `--set` overrides (mode colocated unless --set mode=...),
served on a private local Ray with HAProxy ingress (bench/serving_bench.py `serving`, as
bench/serving_sweep.py). On a GPU machine, with the 8B-shaped dummy model of the other
benches (bench/serving_sweep.py's docstring says how $M is made):

    python3 -m bench.served_vs_offline --set engine.model=$M --set engine.load_format=dummy \\
        --set engine.dtype=bfloat16 --set engine.max_model_len=4096 --rounds 3 -o FILE

A CPU smoke run with the bundled model (SmolLM2-135M):

    python -m bench.served_vs_offline --requests 16 --concurrency 4 --prompt-len 32 \\
        --max-tokens 16 --warmup-requests 2

Each round runs the served phase (warm-up requests, then the measured closed loop through
HTTP with aiohttp, SSE parsed by hand) and the offline phase (warm-up, then the measured
closed loop in the engine actor; with several colocated engines, on all of them at once,
prompts and concurrency split evenly), served first in even rounds and offline first in odd
ones; every phase sends the same prompts opened by a token of its own, so the prefix cache
helps none (bench/harness/served_offline.py). The engine actors come from
`engine_actors` (bench/serving_bench.py: the EngineController's membership, or the router
replica's client before the controller existed). During each
measured phase the CPU use of the router replica(s), the engine actor(s), HAProxy, Serve's
proxy actor and controller and this client is sampled (psutil), and the engine's step
counters. Every wait is bounded (--request-timeout, --phase-timeout, --start-timeout, and a
watchdog at --max-seconds that dumps every thread's stack and exits); failed requests are
counted and their errors reported. The JSON is rewritten after every phase.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from bench.harness.served_offline import (
    DEFINITIONS, CpuMeter, Record, completion_body, haproxy_pids, machine, phase_tokens,
    pooled, random_prompts, served_phase, summarize, with_first_token)
from bench.harness.serving_runs import app_args
from bench.serving_bench import APP, engine_actors, serving
from pd_cluster.config import ModelConfig
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tokenizer import load_tokenizer
from router.app_config import AppConfig
from router.control.model import model_dir, replica_engine

ROOT = Path(__file__).resolve().parents[1]

COLOCATED = ["mode=colocated", "num_prefill=0"]


def _pid(_actor: Any) -> int:
    """Runs in an actor (`__ray_call__`): its process id."""
    import os
    return os.getpid()


def process_pids(engines: list, timeout_s: float) -> dict[str, list[int]]:
    """Process ids by role: the engine actors, each Serve deployment's replicas of the app
    (the router: "OpenAIRouter"), Serve's proxy actor (HAProxy's manager) and controller,
    HAProxy, and this client."""
    pids = {"engine": ray.get([a.__ray_call__.remote(_pid) for a in engines],
                              timeout=timeout_s)}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith(f"SERVE_REPLICA::{APP}#"):
            label = name.split("#")[1]
        elif name.startswith("SERVE_PROXY_ACTOR"):
            label = "serve_proxy"
        elif name.startswith("SERVE_CONTROLLER_ACTOR"):
            label = "serve_controller"
        else:
            continue
        actor = ray.get_actor(name, namespace=entry["namespace"])
        pids.setdefault(label, []).append(ray.get(actor.__ray_call__.remote(_pid),
                                                  timeout=timeout_s))
    pids["haproxy"] = haproxy_pids(pids.get("serve_proxy", []))
    pids["client"] = [os.getpid()]
    return pids


def step_totals(engines: list, timeout_s: float) -> list[dict]:
    return [load.steps for load in ray.get([a.load.remote() for a in engines],
                                           timeout=timeout_s)]


def step_delta(before: list[dict], after: list[dict], seconds: float) -> dict:
    """The engines' step counters over a phase, summed over engines, by step kind."""
    kinds: dict[str, dict[str, float]] = {}
    for b, a in zip(before, after):
        for kind, totals in a.items():
            row = kinds.setdefault(kind, {})
            for key, value in totals.items():
                row[key] = row.get(key, 0) + value - b.get(kind, {}).get(key, 0)
    out = {}
    for kind, row in kinds.items():
        if not row.get("steps"):
            continue
        out[kind] = {"steps": int(row["steps"]), "seconds": round(row["seconds"], 3),
                     "ms_per_step": round(1000 * row["seconds"] / row["steps"], 3)}
        if row.get("batch"):
            out[kind]["decode_seqs_per_step"] = round(row["batch"] / row["steps"], 1)
        if row.get("sum_tokens"):
            out[kind]["prompt_tokens_per_step"] = round(row["sum_tokens"] / row["steps"], 1)
    busy = sum(v["seconds"] for v in out.values())
    return {"by_kind": out, "busy": round(busy / (seconds * max(1, len(after))), 3)
            if seconds > 0 else None}


def offline_phase(engines: list, prompts: list[list[int]], params: SamplingParams,
                  concurrency: int, timeout_s: float) -> tuple[list[Record], float, list[str]]:
    """`run_offline` on every engine at once, the prompts and concurrency split evenly
    (one engine: all of them). Returns the records, the longest engine's seconds, errors."""
    k = len(engines)
    shares = [prompts[i::k] for i in range(k)]
    refs = [a.run_offline.remote(share, params, max(1, concurrency // k))
            for a, share in zip(engines, shares) if share]
    try:
        results = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref)        # an async actor task: its consumers are cancelled
        records = [Record(error=f"not finished when the phase ran past {timeout_s:g} s")
                   for _ in prompts]
        return records, timeout_s, []
    records = [Record.of_offline(row) for r in results for row in r["records"]]
    errors = [e for r in results for e in r["errors"]]
    records += [Record(error=e) for r in results for e in r["errors"]]
    records += [Record(error="failed (error not kept)")
                for r in results for _ in range(r["failed"] - len(r["errors"]))]
    return records, max(r["seconds"] for r in results), errors


class Rounds:
    """The phases of a run on one served app; `report` gains each phase as it ends."""

    def __init__(self, url: str, args: dict, opts: argparse.Namespace, report: dict) -> None:
        self.url, self.opts, self.report = url, opts, report
        self.config = AppConfig.from_args(args)
        path = model_dir(self.config)
        tokenizer = load_tokenizer(path)
        vocab = min(len(tokenizer.hf), ModelConfig.from_dir(path).vocab_size)
        self.prompts = random_prompts(opts.requests, opts.prompt_len, vocab,
                                      tokenizer.hf.all_special_ids, opts.seed)
        self.warm_n = min(opts.warmup_requests, opts.requests)
        # A first token per phase and warm-up: 2 phases x (warm-up, measured) per round.
        self.firsts = iter(phase_tokens(self.prompts, 4 * opts.rounds))
        self.params = SamplingParams(temperature=0.0, max_tokens=opts.max_tokens,
                                     ignore_eos=True)
        self.engines = engine_actors(APP, "decode", opts.request_timeout)
        if not self.engines:
            raise RuntimeError("the app has no READY engine actor")
        self.pids = process_pids(self.engines, opts.request_timeout)
        report.update(engines=len(self.engines), pids=self.pids, rounds=[])
        self.runs: dict[str, list] = {"served": [], "offline": []}

    def run(self) -> None:
        for r in range(self.opts.rounds):
            row: dict[str, Any] = {"round": r}
            self.report["rounds"].append(row)
            # Odd rounds run offline first, so that a drift over the run favours neither.
            order = ("served", "offline") if r % 2 == 0 else ("offline", "served")
            row["order"] = list(order)
            for phase in order:
                row[phase] = getattr(self, phase)()
                write(self.report, self.opts)
            row["ratio"] = _ratio(row["served"]["tok_s"], row["offline"]["tok_s"])
        self.summary()

    def served(self) -> dict:
        """Warm-up, then the measured closed loop, through HTTP."""
        opts, model = self.opts, self.config.engine.model
        warm = [completion_body(model, p, opts.max_tokens)
                for p in with_first_token(self.prompts[:self.warm_n], next(self.firsts))]
        bodies = [completion_body(model, p, opts.max_tokens)
                  for p in with_first_token(self.prompts, next(self.firsts))]
        meter, marks = CpuMeter(self.pids), {}

        def started() -> None:
            marks["steps"] = self.steps()
            meter.start()
        records, seconds, warm_records = asyncio.run(served_phase(
            self.url, bodies, opts.concurrency, opts.request_timeout, opts.phase_timeout,
            warm, started))
        cpu = meter.stop()
        self.runs["served"].append((records, seconds))
        return {**summarize(records, seconds, opts.max_tokens),
                "warmup_errors": sum(not w.ok for w in warm_records), "cpu_cores": cpu,
                "engine_steps": step_delta(marks["steps"], self.steps(), seconds)}

    def offline(self) -> dict:
        """Warm-up, then the measured closed loop, inside the engine actor(s)."""
        opts = self.opts
        warm = with_first_token(self.prompts[:self.warm_n], next(self.firsts))
        prompts = with_first_token(self.prompts, next(self.firsts))
        warm_records, _, _ = offline_phase(self.engines, warm, self.params, opts.concurrency,
                                           opts.phase_timeout) if warm else ([], 0.0, [])
        before, meter = self.steps(), CpuMeter(self.pids)
        meter.start()
        records, seconds, errors = offline_phase(self.engines, prompts, self.params,
                                                 opts.concurrency, opts.phase_timeout)
        cpu = meter.stop()
        self.runs["offline"].append((records, seconds))
        return {**summarize(records, seconds, opts.max_tokens, errors),
                "warmup_errors": sum(not w.ok for w in warm_records), "cpu_cores": cpu,
                "engine_steps": step_delta(before, self.steps(), seconds)}

    def steps(self) -> list[dict]:
        return step_totals(self.engines, self.opts.request_timeout)

    def summary(self) -> None:
        """Both phases over all rounds (records pooled, seconds summed), their ratio, and
        each process role's CPU cores by phase, averaged over rounds."""
        report, rounds = self.report, self.report["rounds"]
        for phase in ("served", "offline"):
            report[phase] = pooled(self.runs[phase], self.opts.max_tokens)
        report["ratio"] = _ratio(report["served"]["tok_s"], report["offline"]["tok_s"])
        report["ratio_per_round"] = [row["ratio"] for row in rounds]
        report["meets_0.95"] = report["ratio"] is not None and report["ratio"] >= 0.95
        report["cpu_cores"] = {
            phase: {label: round(sum(row[phase]["cpu_cores"][label]["cores"]
                                     for row in rounds) / len(rounds), 3)
                    for label in rounds[0][phase]["cpu_cores"]}
            for phase in ("served", "offline")}


def _ratio(served: float | None, offline: float | None) -> float | None:
    return round(served / offline, 4) if served and offline else None


def write(report: dict, opts: argparse.Namespace) -> None:
    if opts.output:
        Path(opts.output).write_text(json.dumps(report, indent=1) + "\n")


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "pd.yaml"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                   help="override an app arg (dotted keys reach nested ones), e.g. "
                        "--set engine.dtype=bfloat16; mode is colocated unless set")
    p.add_argument("--router-replicas", type=int, default=1,
                   help="router replicas (app arg router_replicas; passed only when > 1)")
    p.add_argument("--requests", type=int, default=256, help="measured requests per phase")
    p.add_argument("--concurrency", type=int, default=128, help="requests at a time")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (random ids)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens (ignore_eos)")
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="unmeasured requests before each phase")
    p.add_argument("--rounds", type=int, default=1, help="served + offline phases, repeated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--phase-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--max-seconds", type=float, default=1800.0,
                   help="watchdog: past this, dump every thread's stack and exit")
    p.add_argument("--num-cpus", type=float, help="Ray CPUs (default: detected)")
    p.add_argument("--num-gpus", type=float, help="Ray GPUs (default: detected)")
    p.add_argument("-o", "--output", default=None, help="also write the JSON here")
    opts = p.parse_args(argv)
    if min(opts.requests, opts.concurrency, opts.prompt_len, opts.max_tokens, opts.rounds) < 1:
        p.error("--requests, --concurrency, --prompt-len, --max-tokens and --rounds must be >= 1")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    sets = list(opts.set)
    if not any(s.partition("=")[0] == "mode" for s in sets):
        sets = COLOCATED + sets
    args = app_args(sets, opts.config)
    if opts.router_replicas > 1:       # an AppConfig field being added; not sent until needed
        args["router_replicas"] = opts.router_replicas
    config = AppConfig.from_args(args)      # a bad arg fails here, before Ray starts
    faulthandler.dump_traceback_later(opts.max_seconds, exit=True)
    shown = Path(opts.config).resolve()
    report: dict[str, Any] = {
        "command": " ".join(["python3", "bench/served_vs_offline.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "machine": machine(),
        "config": str(shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown),
        "workload": {"requests": opts.requests, "concurrency": opts.concurrency,
                     "prompt_tokens": opts.prompt_len, "max_tokens": opts.max_tokens,
                     "ignore_eos": True, "temperature": 0.0, "stream": True,
                     "warmup_requests": opts.warmup_requests, "rounds": opts.rounds,
                     "seed": opts.seed},
        "client": "aiohttp, one session, SSE lines parsed by hand; token-id prompts to "
                  "/v1/completions with stream_options.include_usage",
        "args": args, "mode": config.mode, "router_replicas": opts.router_replicas,
        "definitions": DEFINITIONS,
    }
    t0 = time.monotonic()
    try:
        with serving(args, opts) as url:
            report["start_s"] = round(time.monotonic() - t0, 1)
            report["engine_config"] = replica_engine(config, model_dir(config)).model_dump()
            Rounds(url, args, opts, report).run()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"[:2000]
        write(report, opts)
        print(json.dumps(report, indent=1))
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
    report["total_s"] = round(time.monotonic() - t0, 1)
    write(report, opts)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
