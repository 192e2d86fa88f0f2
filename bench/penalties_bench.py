"""Decode step time with every row penalized (presence, frequency, repetition, a logit bias)
against none, one engine, same batch and contexts (pd_cluster/penalties.py rebuilds each
penalized row's token counts every step: its cost grows with the rows' tokens).

    python -m bench.penalties_bench [--batch 64] [--contexts 1024,4096]
        [--steps 50] [--model DIR]

Default model: the Llama-3.1-8B shape, dummy weights, bf16 (--model: a checkpoint directory
instead, e.g. a tiny one to try the script on a CPU). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.engine_bench import start_decoding
from bench.models import dummy_model_dir
from pd_cluster import LLM

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(llm: LLM, batch: int, context: int, steps: int, penalized: bool) -> float:
    """Mean decode step time of `batch` requests of `context` prompt tokens each."""
    engine = llm.engine
    vocab = engine.model_cfg.vocab_size
    extra = dict(PENALTIES, logit_bias={1: 1.0, vocab // 2: -5.0, vocab - 1: 2.0})
    ids = start_decoding(engine, batch, context, 0, vocab, seed=batch + context,
                         **(extra if penalized else {}))
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    elapsed = (time.perf_counter() - began) / steps
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    return elapsed * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    if args.model is None:
        llm = LLM(dummy_model_dir(), load_format="dummy", dtype="bfloat16", max_model_len=8192,
                  max_num_seqs=args.batch, max_num_batched_tokens=16384)
    else:
        llm = LLM(args.model, max_num_seqs=args.batch)
    rows = []
    for context in map(int, args.contexts.split(",")):
        plain = step_ms(llm, args.batch, context, args.steps, False)
        penalized = step_ms(llm, args.batch, context, args.steps, True)
        rows.append({"batch": args.batch, "context": context, "plain_step_ms": plain,
                     "penalized_step_ms": penalized, "ratio": penalized / plain})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": device, "model": args.model or "llama-3.1-8b shape, dummy bf16",
                      "async_scheduling": llm.engine.async_scheduling, "cases": rows},
                     indent=1))


if __name__ == "__main__":
    main()
