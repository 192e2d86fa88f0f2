"""The KV cache hierarchy through HTTP (issue 47): multi-turn conversations served with the
tiers off and on, on one GPU whose KV cache is cut to a quarter of what the conversations in
progress hold.

    python -m bench.kv_tiers_serving -o OUT.json            # one GPU: 8B shape, ~5-6 min
    python -m bench.kv_tiers_serving --dry-run -o OUT.json  # the CPU: tiny model

Both applications are configs/pd.yaml's args, colocated, one engine each, the
Llama-3.1-8B-shaped dummy model with a word-level tokenizer (bench/models.py),
`engine.num_kv_blocks` set so that the KV of the conversations in progress is `--kv-ratio`
(4) times the engine's cache; one with `kv_tiers.enabled` off, one on (its host tier sized to
hold all of it, within /dev/shm's free space). They are served at once on one private local
Ray under /off and /on (each engine half the GPU; the one not measured sits idle), which
saves a start; `--one-at-a-time` serves each alone. Against each in turn: unmeasured warm-up
conversations, then `pd-cluster bench --multi-turn` (pd_cluster/benchmark/multiturn.py):
conversations sharing a system prompt, each turn re-sending the context with a new message
after a think time.

Written as one JSON (rewritten as each run ends): both runs' TTFT p50 / p90, TPOT, goodput
at the same SLOs (and at several TTFT SLOs, from the records), cached prompt tokens per turn,
the off / on ratios; the engine's tier counters over each run (actors/kv_tiers.py
`tier_stats`) and from them the tiers' load bandwidth per prompt, against the pinned host ->
device copy rate measured here with torch.

Every process it starts (the local Ray, Serve, the engines, the host tier) is stopped before
it exits, SIGTERM included; `--budget-s` (470) bounds the whole call. PD_BENCH_KEEP_LOGS=DIR
keeps Ray's logs there.
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

import ray

from bench.harness import kv_tiers
from bench.harness.served_offline import machine
from bench.harness.serving_runs import app_args, get_text, metric_sum, scrape
from bench.models import SHAPES, dummy_model_dir, kv_bytes_per_token, word_tokenizer
from bench.serving_bench import PACKAGES_ROOT, free_port, haproxy_wanted, ingress_env
from pd_cluster.benchmark.multiturn import MultiTurnSettings
from pd_cluster.cli import main as pd_cluster

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
# The GPU run: a 2048-token system prompt, 6 turns of 256 in / 64 out (the last context ~4k),
# 64 conversations in progress (128 in all), 3 s of thought between turns, a short shared
# system prompt and long turns: ~222k tokens of distinct KV against a GPU cache of a quarter
# of that, and more prefill than the GPU can do when the history is recomputed each turn.
# (With a 2k-token shared prompt and 8 s of thought, bench/results/kv_tiers_h200.json's note,
# the cache kept most of what was reused and there was little for a tier to win.)
GPU = {"shape": "llama-3.1-8b", "conversations": 128, "turns": 6, "system": 512, "user": 512,
       "output": 64, "think": "3s", "concurrency": 64, "ttft_slo": "100ms", "tpot_slo": "50ms",
       "max_model_len": 4096, "timeout": 30.0}
# The CPU smoke run (--dry-run): the same shape of load, small enough for 2 cores.
CPU = {"shape": "tiny-llama", "conversations": 8, "turns": 3, "system": 32, "user": 24,
       "output": 8, "think": "300ms", "concurrency": 4, "ttft_slo": "5s", "tpot_slo": "1s",
       "max_model_len": 512, "timeout": 60.0}
RECORD_COLUMNS = ("conversation", "turn", "start", "ok", "prompt_tokens", "cached_tokens", "ttft",
                  "tpot", "e2e")
SHUTDOWN_S = 30.0       # stopping Serve and Ray
# Ray's object store (in /dev/shm too) at a size that leaves /dev/shm to the host tier: the
# benchmark passes no objects of size (Ray's default is 30 % of the host's memory).
OBJECT_STORE_BYTES = 2 * 2**30


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="multi-turn conversations served with the KV "
                                "tiers off and on (issue 47)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke run with the tiny model (defaults below become CPU-sized)")
    p.add_argument("--tiers", default="off,on", help="runs, in order: off, on or both")
    for flag, kind in (("--conversations", int), ("--turns", int), ("--user-tokens", int),
                       ("--system-prompt-tokens", int), ("--output-len", int),
                       ("--think-time", str), ("--concurrency", int), ("--ttft-slo", str),
                       ("--tpot-slo", str)):
        p.add_argument(flag, type=kind, help="as pd-cluster bench --multi-turn's (default: "
                       "the GPU run's or the dry run's, above)")
    p.add_argument("--kv-ratio", type=float, default=4.0,
                   help="KV of the conversations in progress / the GPU cache")
    p.add_argument("--host-bytes", type=int,
                   help="host tier per node (default: the conversations' KV x 1.5, within "
                        "/dev/shm's free space)")
    p.add_argument("--disk-path", help="also a disk tier here (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                   help="more app args, e.g. kv_tiers.min_load_tokens=64")
    p.add_argument("--warmup-conversations", type=int, default=4)
    p.add_argument("--timeout", type=float, help="seconds a request may take (default: 30 on "
                   "the GPU, 60 in the dry run); one past it fails and ends its conversation")
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
    for key, name in (("system", "system_prompt_tokens"), ("user", "user_tokens"),
                      ("output", "output_len"), ("think", "think_time"), *[(k, k) for k in (
                          "conversations", "turns", "concurrency", "ttft_slo", "tpot_slo",
                          "timeout")]):
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
    # The host tier lives in /dev/shm (actors/pool_shm.py), beside Ray's object store: a
    # container's may be small.
    host = min(wanted, max(int((shm - OBJECT_STORE_BYTES) * 0.8), 1)) \
        if shm and not opts.host_bytes else wanted
    return {"kv_bytes_per_token": per_token, "distinct_kv_tokens": distinct,
            "last_context_tokens": last, "gpu_kv_blocks": blocks, "gpu_kv_tokens": blocks * BLOCK,
            "ratio": distinct / (blocks * BLOCK), "host_bytes": host,
            "host_holds_all": host >= distinct * per_token, "dev_shm_free": shm}


def engine_tier_stats(app: str) -> dict:
    """The engine's tier counters (actors/kv_tiers.py `tier_stats`: blocks loaded from the
    host and disk tiers, loads and their seconds, blocks offloaded, recomputed, the tier's
    state and the cost rule's rates); {} with tiers off, {"error": ...} if it cannot say."""
    from bench.serving_bench import engine_actors

    try:
        (actor,) = engine_actors(app=app, role="decode", timeout_s=30)
        return ray.get(actor.tier_stats.remote(), timeout=30)
    except Exception as e:  # noqa: BLE001 - a diagnostic: never lose the measured run
        return {"error": repr(e)[:300]}


def run_args(label: str, base: dict, size: dict, opts: argparse.Namespace) -> dict:
    """The app's args of the run with the tiers `label` (off / on)."""
    args = json.loads(json.dumps(base))
    args["kv_tiers"] = {**args.get("kv_tiers", {}), "enabled": label == "on",
                        "host_bytes": size["host_bytes"], "disk_path": opts.disk_path}
    return args


@contextlib.contextmanager
def serving_apps(apps: dict[str, dict],
                 opts: argparse.Namespace) -> Iterator[dict[str, str | Exception]]:
    """The URL of each application (label -> args), or why it did not start, all served at
    once on one private local Ray, each under the route prefix /<label>; Serve and Ray stopped
    afterwards, whatever happens. As bench/serving_bench.py `serving` does for one, HAProxy ingress included."""
    import psutil  # after ray, which carries it (ray/thirdparty_files) where pip did not
    from ray import serve

    from router.app import build_app

    os.environ["PYTHONPATH"] = os.pathsep.join([str(PACKAGES_ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    os.environ.update(ingress_env(haproxy_wanted()))    # Serve reads them when Ray starts
    # Short (Ray's socket paths), and named after this process: what it leaves is findable.
    work = Path(tempfile.mkdtemp(prefix=f"pdkt{os.getpid()}-", dir="/tmp"))
    ray.init(address="local", num_cpus=opts.num_cpus, num_gpus=opts.num_gpus,
             object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             namespace="serve", log_to_driver=False, _temp_dir=str(work))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(build_app(args), name=f"kvt-{label}",
                                        route_prefix=f"/{label}")
                        for label, args in apps.items()], wait_for_applications_running=False)
        urls: dict[str, str | Exception] = {}
        deadline = time.monotonic() + opts.start_timeout
        for label in apps:
            urls[label] = f"http://127.0.0.1:{port}/{label}"
            # One application failing to start leaves the other to be measured.
            while get_text(f"{urls[label]}/health", timeout=5) is None:
                app = serve.status().applications.get(f"kvt-{label}")
                if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                    urls[label] = RuntimeError(f"the tiers-{label} application failed to "
                                               f"start: {app.message}")
                elif time.monotonic() > deadline:
                    urls[label] = TimeoutError(f"the tiers-{label} application not healthy "
                                               f"after {opts.start_timeout} s")
                if isinstance(urls[label], Exception):
                    print(f"kv_tiers_serving: {urls[label]}", file=sys.stderr)
                    break
                time.sleep(1)
        yield urls
    finally:
        # Ray's processes (raylet, workers, engines, HAProxy under its manager) all descend
        # from this one: what ray.shutdown leaves running is ended by pid.
        started = psutil.Process().children(recursive=True)
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=20)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                print(f"kv_tiers_serving: ending {proc.pid} ({proc.name()}), left by Ray",
                      file=sys.stderr)
                proc.kill()
        keep = os.environ.get("PD_BENCH_KEEP_LOGS")    # a directory: Ray's logs go there
        if keep:                                        # (as bench/serving_bench.py's)
            with contextlib.suppress(OSError):
                shutil.copytree(work / "session_latest" / "logs", Path(keep) / work.name,
                                dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def measure(label: str, url: str, opts: argparse.Namespace, seconds: float,
            block_bytes: int) -> dict:
    """Warm-up conversations, then the measured ones for at most `seconds`, against `url`;
    the run's summary, the tiers' /metrics over it and every request's record."""
    began = time.monotonic()
    common = ["bench", "--multi-turn", "--base-url", url, "--quiet",
              "--user-tokens", str(opts.user_tokens), "--output-len", str(opts.output_len),
              "--ttft-slo", opts.ttft_slo, "--tpot-slo", opts.tpot_slo]
    if opts.warmup_conversations:
        # Kernels compile and connections open on the first requests (hence their long
        # timeout). Another seed and a system prompt of another length: nothing the measured
        # run sends is cached by it.
        pd_cluster([*common, "--conversations", str(opts.warmup_conversations), "--turns", "2",
                    "--think-time", "0", "--concurrency", str(opts.warmup_conversations),
                    "--seed", str(opts.seed + 7919), "--timeout", "120",
                    "--system-prompt-tokens", str(opts.system_prompt_tokens // 2 + 1)])
    seconds -= time.monotonic() - began
    if seconds < 10:
        raise RuntimeError(f"--budget-s: no time left for the tiers-{label} run")
    before, stats_before = scrape(url), engine_tier_stats(f"kvt-{label}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        # No conversation starts a turn after --max-duration; those under way finish theirs.
        rc = pd_cluster([*common, "--system-prompt-tokens", str(opts.system_prompt_tokens),
                         "--conversations", str(opts.conversations), "--turns", str(opts.turns),
                         "--think-time", opts.think_time, "--concurrency", str(opts.concurrency),
                         "--seed", str(opts.seed), "--max-duration", f"{0.8 * seconds:.0f}",
                         "--timeout", f"{opts.timeout:g}",
                         "-o", str(path)])
        if not path.exists():
            raise RuntimeError(f"pd-cluster bench --multi-turn failed (exit {rc})")
        report = json.loads(path.read_text())
    after, stats_after = scrape(url), engine_tier_stats(f"kvt-{label}")
    row = kv_tiers.summary(report)
    row["prefix_cache_hit_tokens"] = (metric_sum(after, "pd_prefix_cache_hits_total")
                                      - metric_sum(before, "pd_prefix_cache_hits_total"))
    row["tier_stats"] = stats_after
    row["tier_metrics"] = kv_tiers.tier_metrics(before, after)
    row["host_loads"] = kv_tiers.host_loads(stats_before, stats_after, block_bytes)
    row["record_columns"] = RECORD_COLUMNS
    row["records"] = [[round(v, 6) if isinstance(v, float) else v
                       for v in (r[c] for c in RECORD_COLUMNS)] for r in report["records"]]
    row["run_s"] = round(time.monotonic() - began, 1)
    return row


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
    opts.num_cpus = math.ceil(1.5 * len(opts.runs)) if opts.dry_run else None
    opts.num_gpus = 0 if opts.dry_run else None
    model = dummy_model_dir(opts.shape, word_tokenizer(
        str(Path(dummy_model_dir(opts.shape)).with_name("pd-cluster-word-tokenizer")),
        SHAPES[opts.shape]["vocab_size"]))
    engine = [f"engine.model={model}", "engine.load_format=dummy",
              f"engine.max_model_len={opts.max_model_len}",
              f"engine.num_kv_blocks={size['gpu_kv_blocks']}", f"engine.block_size={BLOCK}"]
    engine += ["engine.device=cpu", "engine.dtype=float32", "engine.cuda_graphs=false"] \
        if opts.dry_run else ["engine.dtype=bfloat16"]
    if not size["host_holds_all"]:
        print(f"kv_tiers_serving: the host tier ({size['host_bytes']} bytes) holds less than "
              f"the conversations' KV: /dev/shm has {size['dev_shm_free']} bytes free",
              file=sys.stderr)
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
        "pinned_copy": None if opts.dry_run else kv_tiers.pinned_copy(), "runs": {}}
    header = {"command": " ".join(["python3", "bench/kv_tiers_serving.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "commit": git_commit(),
              "machine": machine(),
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
                try:
                    if isinstance(urls[label], Exception):
                        raise urls[label]
                    row = measure(label, urls[label], opts, left / runs_left,
                                  BLOCK * size["kv_bytes_per_token"])
                except Exception as e:  # noqa: BLE001 - the other run is still measured
                    print(f"kv_tiers_serving: the tiers-{label} run failed: {e!r}",
                          file=sys.stderr)
                    row = {"error": repr(e)[:1000], "tier_stats": {}}
                result["runs"][label] = {"start_s": start_s, "served_with": group, **row}
                result["comparison"] = kv_tiers.compare(result["runs"], result["pinned_copy"])
                out.write_text(json.dumps(header, indent=1) + "\n")   # each run kept as it ends
                if row.get("completed", 0) < row.get("requests", 0):
                    print(f"kv_tiers_serving: the tiers-{label} run: {row['completed']} of "
                          f"{row['requests']} requests completed ({row['errors']})",
                          file=sys.stderr)
                state = row["tier_stats"].get("state")
                if label == "on" and state != "on" and "error" not in row:
                    print(f"kv_tiers_serving: the tiers-on engine's tiers are {state!r}, not "
                          f"on ({row['tier_stats']}): its run measured no tier; see its log",
                          file=sys.stderr)
    shown = {label: {k: v for k, v in row.items() if k not in ("records", "per_turn")}
             for label, row in result["runs"].items()}
    print(json.dumps({"sizes": size, "pinned_copy": result["pinned_copy"], "runs": shown,
                      "comparison": result.get("comparison")}, indent=1))
    return 1 if any("error" in row for row in result["runs"].values()) else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
