"""The `pd-cluster` command line: `generate`, `profile`, `profile-serving`, `tune`, `bench`
and `trace`."""
from __future__ import annotations

import argparse
import json
import sys

from pd_cluster.benchmark.cli import add_bench
from pd_cluster.trace_events import add_trace
from pd_cluster.tuning.cli import add_profile, add_profile_serving, add_tune


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine in this process")
    p.add_argument("prompt", nargs="+", help="prompt text (one or more prompts)")
    p.add_argument("--model", default=None, help="model directory (default: bundled SmolLM2)")
    p.add_argument("--chat", action="store_true", help="treat each prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from pd_cluster import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=args.stop, max_tokens=args.max_tokens)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        o = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}))
        else:
            print(o.text if args.chat else prompt + o.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_profile(sub)
    add_profile_serving(sub)
    add_tune(sub)
    add_bench(sub)
    add_trace(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pd-cluster: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
