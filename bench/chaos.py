"""The failure matrix: faults injected one at a time into a served application under a steady
load, and what each cost (`python -m bench.chaos`; the CPU with the bundled default model by
default, any engine through `--set` as bench/serving_sweep.py takes it).

Each fault runs against an application of the shape it needs (SHAPES: configs/pd.yaml's args
with overrides), served here on a private Ray with HAProxy ingress, as shipped:

  fault        shape    what is done
  router       pd       SIGKILL of one of the two router replicas' processes
  controller   pd       SIGKILL of the EngineController replica's process
  prefill      pd       SIGKILL of P's process while a prompt is in its batch
  decode       pd       SIGKILL of a D's process while it decodes streams
  stall        pd       SIGSTOP of P while a prompt is in its batch, for longer than the KV
                        transfer lease, then SIGCONT
  tp_rank      tp       SIGKILL of one rank's process of a TP=2 decode replica
  kv_pool      pooled   SIGKILL of the KV pool actor's process
  node         nodes    the whole node of P (its raylet and every process on it), on a
                        three-node Ray cluster of this machine

Every request has a prompt of its own (none is served from a prefix cache, so P is seen busy);
the reference text of each is its greedy answer when sent again after the fault, once the
application is whole. A fault-free run comes first: the control row, and the TTFT that a
recovered service must get back to. Per fault the report gives (`judge`):
sent, failed, failed_by_design (streams open on a killed router replica: their connection
ends with its process, and no router can resume a client's TCP stream), wrong (text differs
from the reference), duplicated and lost tokens against the reference, recovery_s (from the
fault to the send of the first request from which on every request succeeded within
RECOVERED_TTFT_X of the fault-free TTFT p90), and the KV blocks held by nobody after the load
(held on an engine with no request running or waiting), the most seen and for how long;
whole_again_s (after the load, until every replica is back) and whether each replacement
engine moved KV when the reference was taken (it is used, not merely up).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import difflib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import ray

from bench.harness.faults import FAULTS, engine_pids, replacements_used, wait_whole
from bench.harness.served_offline import machine
from bench.harness.serving_runs import app_args, scrape
from bench.kv_tiers_serving import git_commit
from bench.serving_bench import PACKAGES_ROOT, haproxy_wanted, ingress_env, serve_app
from router.app import HAPROXY_RETRY_ENV

CONFIG = PACKAGES_ROOT / "configs" / "pd.yaml"
ROUTER_HEADER = "x-pd-router"
TWO_ROUTERS = {"router_replicas": 2}
SHAPES: dict[str, dict] = {
    "pd": {"mode": "disaggregated", "num_prefill": 1, "num_decode": 2, **TWO_ROUTERS},
    "tp": {"mode": "disaggregated", "num_prefill": 1, "num_decode": 2,
           "decode_tensor_parallel_size": 2, **TWO_ROUTERS},
    "pooled": {"mode": "pooled", "num_prefill": 1, "num_decode": 2, **TWO_ROUTERS},
    "nodes": {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1, **TWO_ROUTERS},
}
FAULT_SHAPES = {"router": "pd", "controller": "pd", "prefill": "pd", "decode": "pd",
                "stall": "pd", "tp_rank": "tp", "kv_pool": "pooled", "node": "nodes"}
RECOVERED_TTFT_X = 2.0          # a recovered request's TTFT, against the fault-free p90


@dataclasses.dataclass
class Sent:
    """One request of the load: its prompt, when it was sent (monotonic), its answer."""

    prompt: int
    at: float
    router: str = ""
    text: str = ""
    ttft: float | None = None
    ended: float | None = None
    error: str = ""


# -- the load -------------------------------------------------------------------------------------

def prompt_text(i: int, words: int) -> str:
    """Prompt `i` of about `words` words: long enough that P is seen with it in its batch."""
    head = f"Story number {i}: once upon a time, in a land far away, there lived"
    filler = " ".join(f"word{(i * 7 + k) % 97}" for k in range(max(0, words - 14)))
    return f"{filler} {head}".strip()


async def stream_one(session: aiohttp.ClientSession, url: str, sent: Sent,
                     opts: argparse.Namespace) -> None:
    """One greedy streamed completion; its router replica, text and times go into `sent`."""
    body = {"model": "default", "prompt": prompt_text(sent.prompt, opts.prompt_words),
            "max_tokens": opts.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    timeout = opts.request_timeout
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                sent.router = resp.headers.get(ROUTER_HEADER, "")
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[5:]).get("choices") or []:
                        if choice.get("text") and sent.ttft is None:
                            sent.ttft = time.monotonic() - sent.at
                        sent.text += choice.get("text") or ""
        sent.ended = time.monotonic()
    except (aiohttp.ClientError, ValueError, TimeoutError, json.JSONDecodeError) as e:
        sent.error = f"{type(e).__name__}: {e}"[:300]


async def steady_load(url: str, opts: argparse.Namespace, stop: asyncio.Event) -> list[Sent]:
    """One request every 1/rate s, each with a new prompt, until `stop`; then every answer."""
    out: list[Sent] = []
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        while not stop.is_set():
            sent = Sent(next(opts.prompt_ids), time.monotonic())
            out.append(sent)
            tasks.append(asyncio.create_task(stream_one(session, url, sent, opts)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / opts.rate)
        await asyncio.gather(*tasks)
    return out


# -- judging a run --------------------------------------------------------------------------------

def engine_loads(url: str) -> dict[str, dict[str, float]]:
    """Per engine replica ("prefill0", ...): running, waiting and KV blocks used (/metrics)."""
    out: dict[str, dict[str, float]] = {}
    names = {"pd_num_requests_running": "running", "pd_num_requests_waiting": "waiting",
             "pd_kv_blocks_used": "used"}
    for (name, labels), value in scrape(url).items():
        ls = dict(labels)
        if name in names and "role" in ls:
            out.setdefault(f"{ls['role']}{ls['replica']}", {})[names[name]] = value
    return out


def watch_stranded(url: str, watch_s: float) -> dict:
    """KV blocks held on engines with no request running or waiting, from the end of the load
    until there are none (or `watch_s`): the most seen and how long until none."""
    began, most, last_seen = time.monotonic(), 0, None
    while time.monotonic() - began < watch_s:
        with contextlib.suppress(RuntimeError):
            held = sum(int(e.get("used", 0)) for e in engine_loads(url).values()
                       if not e.get("running") and not e.get("waiting"))
            if not held:
                break
            most, last_seen = max(most, held), time.monotonic()
        time.sleep(0.5)
    else:
        return {"stranded_blocks": most, "stranded_s": None}   # still held: not freed
    return {"stranded_blocks": most,
            "stranded_s": 0.0 if last_seen is None else round(last_seen - began, 1)}


def token_diff(tokenizer: Any, got: str, want: str) -> tuple[int, int]:
    """(duplicated, lost) tokens of `got` against `want`: what a diff adds and removes."""
    a, b = tokenizer.encode(want), tokenizer.encode(got)
    same = sum(m.size for m in difflib.SequenceMatcher(None, a, b, autojunk=False)
               .get_matching_blocks())
    return len(b) - same, len(a) - same


def judge(sent: list[Sent], fault: dict | None, reference: dict[int, str], ttft_p90: float,
          tokenizer: Any) -> dict:
    at = fault["at"] if fault else None
    by_design = [s for s in sent if s.error and fault and fault.get("router")
                 and s.router == fault["router"] and s.at < at]
    failed = [s for s in sent if s.error and s not in by_design]
    wrong = [s for s in sent if not s.error and s.text != reference.get(s.prompt, s.text)]
    unjudged = [s for s in sent if not s.error and s.prompt not in reference]
    dup = lost = 0
    for s in wrong:
        d, lo = token_diff(tokenizer, s.text, reference[s.prompt])
        dup, lost = dup + d, lost + lo
    row = {"sent": len(sent), "failed": len(failed), "failed_by_design": len(by_design),
           "wrong": len(wrong), "unjudged": len(unjudged), "duplicated_tokens": dup,
           "lost_tokens": lost,
           "errors": sorted({s.error for s in failed})[:5]}
    if at is not None:
        row["recovery_s"] = recovery_s(sent, at, RECOVERED_TTFT_X * ttft_p90)
    return row


def recovery_s(sent: list[Sent], at: float, ttft_ok: float) -> float | None:
    """From the fault to the send of the first request from which on every request succeeded
    within `ttft_ok`; None when the load ended before that."""
    after = [s for s in sent if s.at >= at]
    good = [not s.error and s.ttft is not None and s.ttft <= ttft_ok for s in after]
    for k in range(len(after)):
        if all(good[k:]):
            return round(after[k].at - at, 2) if k else 0.0
    return None


# -- serving each shape ---------------------------------------------------------------------------

@contextlib.contextmanager
def served(shape: str, opts: argparse.Namespace) -> Iterator[tuple[str, dict]]:
    """(URL, context for the faults) of the application of `shape` on a private Ray: local,
    or a three-node cluster of this machine for "nodes" (a head for the routers and the
    controller, a `prefill` and a `decode` node, as configs/cluster.yaml shapes them)."""
    args = {**app_args(opts.set, CONFIG), **SHAPES[shape]}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGES_ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    os.environ.update({**ingress_env(haproxy_wanted()), **HAPROXY_RETRY_ENV})
    ctx: dict[str, Any] = {"busy_timeout": opts.busy_timeout, "args": args}
    cluster = None
    if shape == "nodes":
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=opts.num_cpus, include_dashboard=False))
        ctx["nodes"] = {role: cluster.add_node(num_cpus=1, resources={role: 1})
                        for role in ("prefill", "decode")}
        ctx["cluster"] = cluster
        ray.init(address=cluster.address, namespace="serve", log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False,
                 namespace="serve", log_to_driver=False)
    try:
        with serve_app(args, opts.start_timeout) as url:
            yield url, ctx
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


async def one_run(url: str, opts: argparse.Namespace, inject: Callable[[], dict] | None
                  ) -> tuple[list[Sent], dict | None]:
    """The load for lead_s + after_s, the fault (if any) injected after lead_s."""
    stop, began = asyncio.Event(), time.monotonic()
    load = asyncio.create_task(steady_load(url, opts, stop))
    fault = None
    try:
        await asyncio.sleep(opts.lead_s)
        if inject is not None:
            fault = await asyncio.to_thread(inject)
        await asyncio.sleep(max(0.0, began + opts.lead_s + opts.after_s - time.monotonic()))
    finally:
        stop.set()
        sent = await load
    return sent, fault


async def replay(url: str, sent: list[Sent], opts: argparse.Namespace) -> dict[int, str]:
    """The reference: each prompt of `sent` again, fault-free, a few at a time."""
    gate = asyncio.Semaphore(4)
    again = [Sent(s.prompt, 0.0) for s in sent]

    async def one(session: aiohttp.ClientSession, s: Sent) -> None:
        async with gate:
            s.at = time.monotonic()
            await stream_one(session, url, s, opts)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*[one(session, s) for s in again])
    return {s.prompt: s.text for s in again if not s.error}


def run_shape(shape: str, faults: list[str], opts: argparse.Namespace, tokenizer: Any
              ) -> list[dict]:
    """Each fault of `faults` against one application of `shape`, after a fault-free run
    (the control row, and the TTFT that recovery is judged against). Every request has a
    prompt of its own, so none is served from a prefix cache and P is seen busy; the
    reference text of each is taken afterwards, fault-free."""
    with served(shape, opts) as (url, ctx):
        return faults_on(url, ctx, shape, faults, opts, tokenizer)


def faults_on(url: str, ctx: dict, shape: str, faults: list[str], opts: argparse.Namespace,
              tokenizer: Any) -> list[dict]:
    """`run_shape` on an application already served at `url` (this process connected to its
    Ray; `ctx` as `served` gives it, "args" at least: a test's own server)."""
    rows = []
    wait_whole(url, ctx["args"], None, opts.whole_timeout)
    sent, _ = asyncio.run(one_run(url, opts, None))
    ttfts = [s.ttft for s in sent if s.ttft is not None]
    p90 = float(np.percentile(ttfts, 90)) if ttfts else opts.request_timeout
    rows.append({"fault": "none", "shape": shape, "ttft_p90_s": round(p90, 3),
                 **judge(sent, None, asyncio.run(replay(url, sent, opts)), p90,
                         tokenizer)})
    for name in faults:
        row: dict[str, Any] = {"fault": name, "shape": shape}
        try:
            before = engine_pids()
            sent, fault = asyncio.run(one_run(url, opts, lambda: FAULTS[name](url, ctx)))
            row["injected"] = {k: v for k, v in fault.items() if k != "at"}
            row.update(watch_stranded(url, opts.watch_s))
            if name != "node":      # nowhere to put a lost node's P back
                row["whole_again_s"] = wait_whole(url, ctx["args"], fault.get("pid"),
                                                  opts.whole_timeout)
            reference = asyncio.run(replay(url, sent, opts))
            row.update(judge(sent, fault, reference, p90, tokenizer))
            row["replacements_used"] = replacements_used(before)
        except Exception as e:  # noqa: BLE001 - the report says it, the next shape runs
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override configs/pd.yaml's args (dotted keys), for every shape")
    p.add_argument("--rate", type=float, default=2.0, help="requests a second")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=200,
                   help="long enough that P is seen busy (a few hundred ms of prefill)")
    p.add_argument("--lead-s", type=float, default=4.0, help="load before the fault")
    p.add_argument("--after-s", type=float, default=20.0, help="load after the fault")
    p.add_argument("--watch-s", type=float, default=60.0,
                   help="how long KV held by nobody is watched after the load")
    p.add_argument("--busy-timeout", type=float, default=30.0)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--whole-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--num-cpus", type=int, default=6, help="the (head) node's logical CPUs")
    p.add_argument("-o", "--output")
    opts = p.parse_args(argv)
    opts.faults = [f for f in opts.faults.split(",") if f]
    opts.prompt_ids = itertools.count()
    unknown = sorted(set(opts.faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    return opts


def main(argv: list[str] | None = None) -> int:
    from pd_cluster.tokenizer import load_tokenizer
    from router.app_config import AppConfig
    from router.control.model import model_dir

    opts = parse(argv)
    tokenizer = load_tokenizer(model_dir(AppConfig.from_args(app_args(opts.set, CONFIG))))
    rows: list[dict] = []
    for shape in dict.fromkeys(FAULT_SHAPES[f] for f in opts.faults):
        rows += run_shape(shape, [f for f in opts.faults if FAULT_SHAPES[f] == shape],
                          opts, tokenizer)
    report = {"command": " ".join(["python3 -m bench.chaos",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "commit": git_commit(), "machine": machine(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "settings": {k: v for k, v in vars(opts).items()
                           if k not in ("output", "prompt_ids")},
              "definitions": __doc__.split("Every request has")[1].strip(),
              "faults": rows}
    if opts.output:
        Path(opts.output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
