"""Decode throughput with and without a JSON-schema constraint, in one engine and one run.

    python -m bench.structured_decode [--shape llama-3.1-8b | --tiny] [--batch 64]
        [--context 512] [--steps 64] [--tokenizer DIR] [--sync]

Each mode keeps `batch` requests decoding (random prompts of `context` tokens, temperature 1 on
dummy weights, so every kind of token is sampled) and times `steps` engine steps after a
warm-up. Unconstrained requests ignore EOS; constrained ones follow a schema whose grammar
cannot end during the run (an array of at least 10,000 small objects: integers, short strings,
booleans), so every step computes a full batch of masks. Prints one JSON object: tokens/s of
each mode, their ratio, and the host milliseconds per step spent in the grammar (advancing
matchers, computing masks, applying them), which the device's forward pass hides while it is
shorter than the step.

The grammar needs a tokenizer: `--tokenizer` names a directory with the tokenizer files
(default: the bundled model's, SmolLM2's 49k vocabulary), copied beside the dummy config.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.models import dummy_model_dir
from pd_cluster import LLM, SamplingParams
from pd_cluster.structured import GrammarSpec

ITEM = {"type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "name": {"type": "string", "maxLength": 12},
                       "ok": {"type": "boolean"}}}
ENDLESS = {"type": "array", "minItems": 10000, "items": ITEM}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class GrammarTimer:
    """Host time spent in the engine's grammar step (wraps GrammarConstraint.apply)."""

    def __init__(self, grammar) -> None:
        self.seconds, self._apply = 0.0, grammar.apply
        grammar.apply = self

    def __call__(self, *args) -> None:
        t = time.perf_counter()
        self._apply(*args)
        self.seconds += time.perf_counter() - t


def decode(llm: LLM, batch: int, context: int, steps: int, warmup: int,
           grammar: GrammarSpec | None, timer: GrammarTimer) -> dict:
    engine, rng = llm.engine, random.Random(batch + context)
    vocab = len(engine.tokenizer.hf)
    room = engine.max_model_len - context - 1
    params = SamplingParams(temperature=1.0, max_tokens=room, ignore_eos=grammar is None,
                            grammar=grammar)
    ids = [engine.add_request([rng.randrange(100, vocab) for _ in range(context)], params)
           for _ in range(batch)]
    reqs = [engine.scheduler.requests[i] for i in ids]
    while any(r.num_computed_tokens < context for r in reqs):
        engine.step()
    for _ in range(warmup):
        engine.step()
    sync(engine.runner.device)
    before, timer.seconds = sum(len(r.output_token_ids) for r in reqs), 0.0
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.runner.device)
    seconds = time.perf_counter() - t
    tokens = sum(len(r.output_token_ids) for r in reqs) - before
    running = sum(not r.is_finished for r in reqs)
    sample = engine.tokenizer.decode([t for t in reqs[0].output_token_ids if t >= 0][:48])
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    return {"constrained": grammar is not None, "running_at_end": running,
            "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "step_ms": seconds / steps * 1e3, "grammar_host_ms_per_step":
                timer.seconds / steps * 1e3, "output_sample": sample}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized model (smoke run)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tokenizer", default=None, help="directory of tokenizer files")
    ap.add_argument("--sync", action="store_true", help="async scheduling off")
    args = ap.parse_args()
    tok_dir = args.tokenizer
    if tok_dir is None:
        from pd_cluster.default_model import default_model_path
        tok_dir = default_model_path()
    shape = "tiny-llama" if args.tiny else args.shape
    cuda = torch.cuda.is_available()
    llm = LLM(dummy_model_dir(shape, tokenizer_from=tok_dir), load_format="dummy",
              dtype="bfloat16" if cuda else "float32", max_num_seqs=max(64, args.batch),
              max_num_batched_tokens=16384 if cuda else 4096,
              max_model_len=args.context + args.warmup + args.steps + 64,
              async_scheduling=not args.sync)
    timer = GrammarTimer(llm.engine.runner.grammar)
    runs = [decode(llm, args.batch, args.context, args.steps, args.warmup, g, timer)
            for g in (None, GrammarSpec.json_schema(ENDLESS))]
    free, constrained = runs
    print(json.dumps({
        "device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape,
        "batch": args.batch, "context": args.context, "steps": args.steps,
        "async_scheduling": not args.sync, "unconstrained_tok_s": free["tok_s"],
        "constrained_tok_s": constrained["tok_s"],
        "ratio": constrained["tok_s"] / free["tok_s"], "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
