"""The KV cache hierarchy through HTTP (issue 47): multi-turn conversations served with the
tiers off, then on, on one GPU with its KV cache cut to a quarter of what the conversations
in progress hold.

    python -m bench.kv_tiers_serving -o OUT.json            # one GPU: 8B shape, ~6 min
    python -m bench.kv_tiers_serving --dry-run -o OUT.json  # CPU, tiny model, < 1 min

Each run serves configs/pd.yaml's args, colocated, one engine, on a private local Ray
(bench/serving_bench.py `serving`, the Llama-3.1-8B-shaped dummy model with a word-level
tokenizer, bench/models.py) with `engine.num_kv_blocks` set so that the KV of the
conversations in progress is `--kv-ratio` (4) times the GPU cache, and `kv_tiers.enabled`
off or on (host tier sized to hold them all, within /dev/shm's free space). Against each:
unmeasured warm-up conversations, then `pd-cluster bench --multi-turn`
(pd_cluster/benchmark/multiturn.py): conversations sharing a system prompt, each turn
re-sending the context with a new message after a think time. Written as one JSON: both
runs' TTFT p50 / p90, TPOT, goodput at the same SLOs (and at several TTFT SLOs, from the
records), cached prompt tokens per turn, the off / on ratios; the /metrics series of the
tiers (any `pd_kv_tier*`) over each run, and from them the host tier's load bandwidth against
the pinned host -> device copy rate measured here with torch.

Every process it starts (the local Ray, Serve, the engines) is stopped before it exits,
SIGTERM included; `--budget-s` bounds the whole call.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray

from bench.harness.serving_runs import app_args, get_text, metric_sum, scrape
from bench.models import SHAPES, dummy_model_dir, kv_bytes_per_token, word_tokenizer
from bench.serving_bench import PACKAGES_ROOT, free_port, haproxy_wanted, ingress_env
from pd_cluster.benchmark.multiturn import MultiTurnSettings
from pd_cluster.cli import main as pd_cluster

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
# The GPU run: 2048-token system prompt, 6 turns of 256 in / 64 out (last context ~3.9k), 64
# conversations in progress with 8 s of thought: ~125k tokens of distinct KV against a GPU
# cache of a quarter of that, while the few requests running at a time (~6) fit in it.
GPU = {"shape": "llama-3.1-8b", "conversations": 64, "turns": 6, "system": 2048, "user": 256,
       "output": 64, "think": "8s", "concurrency": 64, "ttft_slo": "100ms", "tpot_slo": "50ms",
       "max_model_len": 4096}
# The CPU smoke run (--dry-run): the same shape of load, small enough for 2 cores.
CPU = {"shape": "tiny-llama", "conversations": 8, "turns": 3, "system": 32, "user": 24,
       "output": 8, "think": "300ms", "concurrency": 4, "ttft_slo": "5s", "tpot_slo": "1s",
       "max_model_len": 512}
RECORD_COLUMNS = ("conversation", "turn", "start", "ok", "prompt_tokens", "cached_tokens", "ttft",
                  "tpot", "e2e")
TTFT_SLOS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)      # goodput re-judged at these, from records
SHUTDOWN_S = 30.0       # stopping Serve and Ray


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke run with the tiny model (defaults below become CPU-sized)")
    p.add_argument("--tiers", default="off,on", help="runs, in order: off, on or both")
    p.add_argument("--conversations", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--system-prompt-tokens", type=int)
    p.add_argument("--user-tokens", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--think-time")
    p.add_argument("--concurrency", type=int, help="conversations in progress")
    p.add_argument("--ttft-slo")
    p.add_argument("--tpot-slo")
    p.add_argument("--kv-ratio", type=float, default=4.0,
                   help="KV of the conversations in progress / the GPU cache")
    p.add_argument("--host-bytes", type=int,
                   help="host tier per node (default: the conversations' KV x 1.5, within "
                        "/dev/shm's free space)")
    p.add_argument("--disk-path", help="also a disk tier here (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                   help="more app args, e.g. kv_tiers.min_load_tokens=64")
    p.add_argument("--warmup-conversations", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=470.0,
                   help="the whole call; each measured run is cut to fit")
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--one-at-a-time", action="store_true",
                   help="serve each run's application alone (default: both at once, each "
                        "engine on half the GPU, measured one after the other)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    opts = p.parse_args(argv)
    defaults = CPU if opts.dry_run else GPU
    for key, name in (("conversations", "conversations"), ("turns", "turns"),
                      ("system", "system_prompt_tokens"), ("user", "user_tokens"),
                      ("output", "output_len"), ("think", "think_time"),
                      ("concurrency", "concurrency"), ("ttft_slo", "ttft_slo"),
                      ("tpot_slo", "tpot_slo")):
        if getattr(opts, name) is None:
            setattr(opts, name, defaults[key])
    opts.shape, opts.max_model_len = defaults["shape"], defaults["max_model_len"]
    opts.runs = [t.strip() for t in opts.tiers.split(",") if t.strip()]
    if not opts.runs or set(opts.runs) - {"off", "on"} or len(set(opts.runs)) < len(opts.runs):
        p.error(f"--tiers: a comma list of off and on, each once; got {opts.tiers!r}")
    if opts.kv_ratio < 1:
        p.error("--kv-ratio: must be >= 1 (the GPU cache holding less than the conversations)")
    return opts


def workload(opts: argparse.Namespace) -> MultiTurnSettings:
    settings = MultiTurnSettings(opts.conversations, opts.turns, opts.system_prompt_tokens,
                                 opts.user_tokens, opts.output_len, 0.0, opts.concurrency)
    settings.check()
    last = settings.context_tokens(settings.turns - 1) + settings.output_tokens
    if last > opts.max_model_len:
        raise SystemExit(f"the last turn's context ({last} tokens) exceeds max_model_len "
                         f"{opts.max_model_len}: fewer --turns or shorter messages")
    return settings


def sizes(opts: argparse.Namespace, settings: MultiTurnSettings) -> dict:
    """GPU blocks and host-tier bytes: the distinct KV of the conversations in progress (the
    shared system prompt once, each conversation's own turns and answers) over the ratio."""
    last = settings.context_tokens(settings.turns - 1) + settings.output_tokens
    in_progress = min(settings.concurrency, settings.conversations)
    distinct = settings.system_tokens + in_progress * (last - settings.system_tokens)
    per_token = kv_bytes_per_token(SHAPES[opts.shape],
                                   2 if SHAPES[opts.shape]["torch_dtype"] == "bfloat16" else 4)
    # At least a full-length sequence's blocks and one more, or no turn could run.
    blocks = max(math.ceil(distinct / opts.kv_ratio / BLOCK), math.ceil(last / BLOCK) + 1)
    wanted = opts.host_bytes or int(distinct * per_token * 1.5)
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    # The host tier lives in /dev/shm (actors/pool_shm.py): a container's may be small.
    host = min(wanted, int(shm * 0.8)) if shm and not opts.host_bytes else wanted
    return {"kv_bytes_per_token": per_token, "distinct_kv_tokens": distinct,
            "last_context_tokens": last, "gpu_kv_blocks": blocks, "gpu_kv_tokens": blocks * BLOCK,
            "ratio": distinct / (blocks * BLOCK), "host_bytes": host,
            "host_holds_all": host >= distinct * per_token, "dev_shm_free": shm}


def pinned_copy() -> dict | None:
    """Pinned host -> GPU copy rate: one 256 MiB copy (a 2k-token 8B prompt's KV), and the
    same bytes in 32 KiB pieces (one block's K or V of one layer at block 16), median of 5."""
    import torch

    if not torch.cuda.is_available():
        return None
    nbytes, piece = 256 * 2**20, 32 * 2**10
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"bytes": nbytes, "whole_gbps": _copy_rate(host, dev, nbytes), "piece_bytes": piece,
           "pieces_gbps": _copy_rate(host, dev, piece)}
    del host, dev
    torch.cuda.empty_cache()
    return out


def _copy_rate(host: Any, dev: Any, step: int) -> float:
    """GB/s of copying `host` into `dev` in `step`-byte pieces: median of 5 after a warm-up."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(6):
        start.record()
        for at in range(0, host.numel(), step):
            dev[at:at + step].copy_(host[at:at + step], non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return host.numel() / float(np.median(times[1:])) / 1e9


def tier_series(metrics: dict) -> dict[str, float]:
    """Every /metrics sample of the tiers (`pd_kv_tier*`), keyed `name{label=value,...}`."""
    return {name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}": value
            for (name, labels), value in metrics.items() if name.startswith("pd_kv_tier")}


def host_loads(before: dict, after: dict) -> dict | None:
    """The host tier's loads over a run, from the tiers' counters: bytes and seconds of
    series whose name says load and whose tier label (or name) says host."""
    def delta(word: str) -> float:
        total = 0.0
        for key, value in after.items():
            name, _, labels = key.partition("{")
            if "load" in name and word in name and ("tier=host" in labels or "host" in name):
                total += value - before.get(key, 0.0)
        return total

    nbytes, seconds = delta("bytes"), delta("seconds")
    if not nbytes:
        return None
    return {"bytes": nbytes, "seconds": seconds,
            "gbps": nbytes / seconds / 1e9 if seconds else None}


def run_args(label: str, base: dict, size: dict, opts: argparse.Namespace) -> dict:
    """The app's args of the run with the tiers `label` (off / on)."""
    args = json.loads(json.dumps(base))
    args["kv_tiers"] = {**args.get("kv_tiers", {}), "enabled": label == "on",
                        "host_bytes": size["host_bytes"], "disk_path": opts.disk_path}
    return args


@contextlib.contextmanager
def serving_apps(apps: dict[str, dict], opts: argparse.Namespace) -> Iterator[dict[str, str]]:
    """The URL of each application (label -> args), all served at once on one private local
    Ray, each under the route prefix /<label>; Serve and Ray stopped afterwards, whatever
    happens. As bench/serving_bench.py `serving` does for one, HAProxy ingress included."""
    from ray import serve

    from router.app import build_app

    os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGES_ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    os.environ.update(ingress_env(haproxy_wanted()))    # Serve reads them when Ray starts
    # Short (Ray's socket paths), and named after this process: what it leaves is findable.
    work = Path(tempfile.mkdtemp(prefix=f"pdkt{os.getpid()}-", dir="/tmp"))
    ray.init(address="local", num_cpus=opts.num_cpus, num_gpus=opts.num_gpus,
             include_dashboard=False, namespace="serve", log_to_driver=False,
             _temp_dir=str(work))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(build_app(args), name=f"kvt-{label}",
                                        route_prefix=f"/{label}")
                        for label, args in apps.items()], wait_for_applications_running=False)
        urls = {label: f"http://127.0.0.1:{port}/{label}" for label in apps}
        deadline = time.monotonic() + opts.start_timeout
        for label, url in urls.items():
            while get_text(f"{url}/health", timeout=5) is None:
                app = serve.status().applications.get(f"kvt-{label}")
                if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                    raise RuntimeError(f"the tiers-{label} application failed to start: "
                                       f"{app.message}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the tiers-{label} application not healthy after "
                                       f"{opts.start_timeout} s")
                time.sleep(1)
        yield urls
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def measure(label: str, url: str, opts: argparse.Namespace, seconds: float) -> dict:
    """Warm-up conversations, then the measured ones for at most `seconds`, against `url`;
    the run's summary, the tiers' /metrics over it and every request's record."""
    began = time.monotonic()
    common = ["bench", "--multi-turn", "--base-url", url, "--quiet",
              "--user-tokens", str(opts.user_tokens), "--output-len", str(opts.output_len),
              "--ttft-slo", opts.ttft_slo, "--tpot-slo", opts.tpot_slo, "--timeout", "120"]
    if opts.warmup_conversations:
        # Kernels compile and connections open on the first requests. Another seed and a
        # system prompt of another length: nothing the measured run sends is cached by it.
        pd_cluster([*common, "--conversations", str(opts.warmup_conversations), "--turns", "2",
                    "--think-time", "0", "--concurrency", str(opts.warmup_conversations),
                    "--seed", str(opts.seed + 7919),
                    "--system-prompt-tokens", str(opts.system_prompt_tokens // 2 + 1)])
    seconds -= time.monotonic() - began
    if seconds < 10:
        raise SystemExit(f"--budget-s: no time left for the tiers-{label} run")
    before = scrape(url)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        # No conversation starts a turn after --max-duration; those under way finish theirs.
        rc = pd_cluster([*common, "--system-prompt-tokens", str(opts.system_prompt_tokens),
                         "--conversations", str(opts.conversations), "--turns", str(opts.turns),
                         "--think-time", opts.think_time, "--concurrency", str(opts.concurrency),
                         "--seed", str(opts.seed), "--max-duration", f"{0.8 * seconds:.0f}",
                         "-o", str(path)])
        if not path.exists():
            raise RuntimeError(f"pd-cluster bench --multi-turn failed (exit {rc})")
        report = json.loads(path.read_text())
    after = scrape(url)
    tiers_before, tiers_after = tier_series(before), tier_series(after)
    row = summary(report)
    row["prefix_cache_hit_tokens"] = (metric_sum(after, "pd_prefix_cache_hits_total")
                                      - metric_sum(before, "pd_prefix_cache_hits_total"))
    row["tier_metrics"] = {k: v - tiers_before.get(k, 0.0) for k, v in tiers_after.items()}
    row["host_loads"] = host_loads(tiers_before, tiers_after)
    row["record_columns"] = RECORD_COLUMNS
    row["records"] = [[_round(r[c]) for c in RECORD_COLUMNS] for r in report["records"]]
    row["run_s"] = round(time.monotonic() - began, 1)
    return row


def _round(v: Any) -> Any:
    return round(v, 6) if isinstance(v, float) else v


def summary(report: dict) -> dict:
    """The numbers a comparison needs, in ms where they are latencies."""
    ms = lambda v: None if v is None else round(v * 1e3, 3)
    ok = [r for r in report["records"] if r["ok"]]
    tpot_ok = [r for r in ok if r["tpot"] is not None and r["tpot"] <= report["slo"]["tpot"]]
    return {
        "requests": report["requests"], "completed": report["completed"],
        "errors": report["errors"], "duration_s": round(report["duration_s"], 3),
        "conversations_completed": report["conversations_completed"],
        "ttft_ms_p50": ms(report["ttft"]["p50"]), "ttft_ms_p90": ms(report["ttft"]["p90"]),
        "tpot_ms_p50": ms(report["tpot"]["p50"]), "tpot_ms_p90": ms(report["tpot"]["p90"]),
        "request_throughput": report["request_throughput"],
        "output_token_throughput": report["output_token_throughput"],
        "goodput": report["goodput"], "slo_attainment": report["slo_attainment"],
        "goodput_at_ttft_slo": {f"{int(s * 1e3)}ms": sum(r["ttft"] <= s for r in tpot_ok)
                                / report["duration_s"] for s in TTFT_SLOS},
        "cached_fraction": report["cached_fraction"],
        "per_turn": [{"turn": t["turn"], "completed": t["completed"],
                      "ttft_ms_p50": ms(t["ttft"]["p50"]), "ttft_ms_p90": ms(t["ttft"]["p90"]),
                      "prompt_tokens_mean": t["prompt_tokens_mean"],
                      "cached_tokens_mean": t["cached_tokens_mean"],
                      "slo_attainment": t["slo_attainment"]} for t in report["per_turn"]],
    }


def compare(runs: dict, copy: dict | None) -> dict | None:
    if not {"off", "on"} <= set(runs):
        return None
    off, on = runs["off"], runs["on"]
    div = lambda a, b: round(a / b, 3) if a is not None and b else None
    out = {"ttft_p50_off_over_on": div(off["ttft_ms_p50"], on["ttft_ms_p50"]),
           "ttft_p90_off_over_on": div(off["ttft_ms_p90"], on["ttft_ms_p90"]),
           "goodput_on_over_off": div(on["goodput"], off["goodput"]),
           "goodput_on_over_off_at_ttft_slo": {
               k: div(on["goodput_at_ttft_slo"][k], v)
               for k, v in off["goodput_at_ttft_slo"].items()},
           "tiers_seen_in_metrics": bool(on["tier_metrics"])}
    loads = on.get("host_loads")
    if loads and loads.get("gbps") and copy:
        out["host_load_gbps_over_pinned_copy"] = div(loads["gbps"], copy["whole_gbps"])
    return out


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                              check=False, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _stop_on_sigterm() -> None:
    """A SIGTERM (a time limit) unwinds like Ctrl-C, so `serving` stops Serve and Ray."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    deadline = time.monotonic() + opts.budget_s
    _stop_on_sigterm()
    settings = workload(opts)
    size = sizes(opts, settings)
    # Ray's logical CPUs of the dry run: an engine (0.5) and a router (1) per application.
    opts.num_cpus = 1.5 * len(opts.runs) if opts.dry_run else None
    opts.num_gpus = 0 if opts.dry_run else None
    model = dummy_model_dir(opts.shape, word_tokenizer(
        str(Path(dummy_model_dir(opts.shape)).with_name("pd-cluster-word-tokenizer")),
        SHAPES[opts.shape]["vocab_size"]))
    engine = [f"engine.model={model}", "engine.load_format=dummy",
              f"engine.max_model_len={opts.max_model_len}",
              f"engine.num_kv_blocks={size['gpu_kv_blocks']}", f"engine.block_size={BLOCK}"]
    engine += ["engine.device=cpu", "engine.dtype=float32", "engine.cuda_graphs=false"] \
        if opts.dry_run else ["engine.dtype=bfloat16"]
    base = app_args([*engine, "mode=colocated", "num_prefill=0", "num_decode=1",
                     f"limits.max_tokens={min(4096, opts.max_model_len)}", *opts.set],
                    REPO / "configs" / "pd.yaml")
    from router.app_config import AppConfig
    for label in opts.runs:             # a bad arg fails here, before Ray starts
        AppConfig.from_args(run_args(label, base, size, opts))
    result: dict[str, Any] = {
        "workload": {**{k: getattr(settings, k) for k in ("conversations", "turns",
                                                          "system_tokens", "user_tokens",
                                                          "output_tokens", "concurrency")},
                     "think_time": opts.think_time, "ttft_slo": opts.ttft_slo,
                     "tpot_slo": opts.tpot_slo},
        "shape": opts.shape, "sizes": size, "app_args": base,
        "pinned_copy": None if opts.dry_run else pinned_copy(), "runs": {}}
    header = {"command": " ".join(["python3", "bench/kv_tiers_serving.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "commit": git_commit(),
              "machine": _machine(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "result": result}
    out = Path(opts.output)
    # Both applications at once (each engine half the GPU, idle while the other is measured):
    # one start instead of two; --one-at-a-time serves each alone.
    groups = [[label] for label in opts.runs] if opts.one_at_a_time else [opts.runs]
    for n, group in enumerate(groups):
        began = time.monotonic()
        share = {"num_gpus": 0 if opts.dry_run else 1 / len(group),
                 "num_cpus": 0.5 if opts.dry_run else 1}
        apps = {label: {**run_args(label, base, size, opts), "decode_resources": share}
                for label in group}
        with serving_apps(apps, opts) as urls:
            start_s = round(time.monotonic() - began, 1)
            for k, label in enumerate(group):
                # This run's share of what is left, each later group needing a start too.
                left = deadline - time.monotonic() - SHUTDOWN_S * (len(groups) - n)
                left -= start_s * (len(groups) - n - 1)
                runs_left = len(group) - k + sum(len(g) for g in groups[n + 1:])
                row = measure(label, urls[label], opts, left / runs_left)
                result["runs"][label] = {"start_s": start_s, "served_with": group, **row}
                result["comparison"] = compare(result["runs"], result["pinned_copy"])
                out.write_text(json.dumps(header, indent=1) + "\n")   # each run kept as it ends
    shown = {label: {k: v for k, v in row.items() if k not in ("records", "per_turn")}
             for label, row in result["runs"].items()}
    print(json.dumps({"sizes": size, "pinned_copy": result["pinned_copy"], "runs": shown,
                      "comparison": result.get("comparison")}, indent=1))
    return 0


def _machine() -> dict:
    import platform

    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "cpus": os.cpu_count(), "python": platform.python_version()}


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
