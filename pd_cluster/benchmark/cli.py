"""`pd-cluster bench`: its arguments, the run, and the report it prints and writes."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import asdict

# --multi-turn's own options and their defaults (None on the command line: given or not).
MULTI_TURN_DEFAULTS = {"conversations": 32, "turns": 4, "system_prompt_tokens": 512,
                       "user_tokens": 64, "think_time": "1s"}


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (streaming)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server URL, with or without /v1")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--workload", help="lengths file: JSON(L) or CSV with input_len, output_len")
    p.add_argument("--input-len", help="input length distribution in tokens (default 512), "
                   "e.g. 32, uniform:100:1024, normal:512:128")
    p.add_argument("--output-len", help="output length distribution (default 128)")
    p.add_argument("-n", "--num-requests", type=int, help="requests to send (default 100)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="requests/s (inf: all at once); default 1; "
                      "with --multi-turn new conversations/s")
    load.add_argument("--concurrency", type=int, help="requests in flight, back to back; "
                      "with --multi-turn conversations in progress (default 8)")
    p.add_argument("--burstiness", type=float, help="gamma shape of arrival gaps; 1 (the "
                   "default) = Poisson, < 1 burstier")
    turns = p.add_argument_group("multi-turn conversations (pd_cluster/benchmark/multiturn.py)")
    turns.add_argument("--multi-turn", action="store_true",
                       help="conversations sharing a system prompt, each turn re-sending the "
                       "context so far plus a new message; --output-len is each answer's "
                       "length (an integer); reported per turn, with the tokens cached")
    turns.add_argument("--conversations", type=int, help="conversations in all (default 32)")
    turns.add_argument("--turns", type=int, help="turns of each conversation (default 4)")
    turns.add_argument("--system-prompt-tokens", type=int,
                       help="the shared system prompt's length (default 512)")
    turns.add_argument("--user-tokens", type=int, help="each user message's length (default 64)")
    turns.add_argument("--think-time", help="mean pause between an answer and the next "
                       "message (exponential), e.g. 2s, 500ms, 0 (default 1s)")
    p.add_argument("--ttft-slo", default="1s", help="goodput's TTFT objective, e.g. 500ms")
    p.add_argument("--tpot-slo", default="100ms", help="goodput's TPOT objective, e.g. 50ms")
    p.add_argument("--slo-percentile", default="p90", help="reported with the SLOs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="seconds after which no new request starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", help="JSON report with per-request records")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    if args.multi_turn:
        return _bench_multi_turn(args)
    for name in MULTI_TURN_DEFAULTS:
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} needs --multi-turn")
    from pd_cluster.benchmark.client import Endpoint
    from pd_cluster.benchmark.loadgen import LoadSettings, check_load, run_load
    from pd_cluster.benchmark.metrics import format_summary, summarize
    from pd_cluster.tuning.slo import SLO
    from pd_cluster.tuning.workload import Workload

    workload = Workload.from_args(args.workload, args.input_len, args.output_len)
    slo = SLO.parse(args.ttft_slo, args.tpot_slo, args.slo_percentile)
    rate = 1.0 if args.rate is None and args.concurrency is None else args.rate
    load = LoadSettings(100 if args.num_requests is None else args.num_requests, rate,
                        args.concurrency,
                        1.0 if args.burstiness is None else args.burstiness,
                        args.timeout, args.max_duration, args.seed)
    check_load(load)
    base, model = _base_and_model(args)
    endpoint = Endpoint(base, model, args.api_key, args.chat)
    records, duration, t0 = asyncio.run(run_load(endpoint, workload, load, not args.quiet))
    report = summarize(records, duration, slo)
    report["config"] = {"base_url": base, "model": model, "chat": args.chat,
                        "workload": workload.source, **asdict(load)}
    print(format_summary(report))
    if args.output:
        report["records"] = [asdict(r) for r in records]
        report["records_clock_origin"] = t0   # records' `start` + this = the send's monotonic time
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.output}")
    return 0 if report["completed"] else 1


def _bench_multi_turn(args: argparse.Namespace) -> int:
    """`--multi-turn`: the conversations of multiturn.py; the summary, a per-turn table, and
    with -o the JSON report (-o -: to stdout, the summary then to stderr)."""
    import re
    import sys

    from pd_cluster.benchmark import multiturn
    from pd_cluster.benchmark.client import Endpoint
    from pd_cluster.benchmark.metrics import format_summary
    from pd_cluster.tuning.slo import SLO, parse_duration

    for flag, given in (("--workload", args.workload), ("--input-len", args.input_len),
                        ("-n", args.num_requests), ("--burstiness", args.burstiness)):
        if given is not None:
            raise ValueError(f"{flag} does not apply to --multi-turn (its prompts are the "
                             "conversations': --system-prompt-tokens, --user-tokens, --turns)")
    for name, default in MULTI_TURN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    output = args.output_len or "128"
    if not output.strip().isdigit():
        raise ValueError(f"--output-len: --multi-turn takes one length in tokens, got {output!r}")
    think = 0.0 if re.fullmatch(r"0+(\.0*)?(s|ms|us)?", args.think_time.strip()) else \
        parse_duration(args.think_time, "--think-time")
    concurrency = args.concurrency
    if args.rate is None and concurrency is None:
        concurrency = 8
    settings = multiturn.MultiTurnSettings(args.conversations, args.turns, args.system_prompt_tokens,
                                 args.user_tokens, int(output), think, concurrency, args.rate,
                                 args.timeout, args.max_duration, args.seed)
    settings.check()
    slo = SLO.parse(args.ttft_slo, args.tpot_slo, args.slo_percentile)
    base, model = _base_and_model(args)
    endpoint = Endpoint(base, model, args.api_key, args.chat)
    turns, duration, t0 = asyncio.run(multiturn.run_conversations(endpoint, settings, not args.quiet))
    result = multiturn.report(turns, duration, slo, settings)
    result["config"] = {"base_url": base, "model": model, "chat": args.chat,
                        **asdict(settings)}
    shown = sys.stderr if args.output == "-" else sys.stdout
    print(format_summary(result), file=shown)
    print(multiturn.format_turns(result["per_turn"]), file=shown)
    if args.output:
        result["records"] = multiturn.records_json(turns)
        result["records_clock_origin"] = t0
        text = json.dumps(result, indent=1)
        if args.output == "-":
            print(text)
        else:
            with open(args.output, "w") as f:
                f.write(text)
            print(f"wrote {args.output}")
    return 0 if result["completed"] else 1


def _base_and_model(args: argparse.Namespace) -> tuple[str, str]:
    base = args.base_url.rstrip("/")
    base = base if base.endswith("/v1") else f"{base}/v1"
    return base, args.model or asyncio.run(_first_model(base, args.api_key))


async def _first_model(base: str, api_key: str | None) -> str:
    """The first model the server lists; a clear error when it cannot be asked."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(f"{base}/models", headers=headers) as resp:
                if resp.status != 200:
                    raise ValueError(f"{base}/models answered HTTP {resp.status}; pass --model")
                data = (await resp.json()).get("data") or []
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot reach {base}: {e}") from None
    if not data:
        raise ValueError(f"{base}/models lists no model; pass --model")
    return data[0]["id"]
