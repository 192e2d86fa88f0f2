"""Speculative decoding: what it gains at batch 1 and what it costs at batch 64.

    python -m bench.spec_decode [--out bench/results/spec_decode_h200.json]
    python -m bench.spec_decode --tiny        # CPU smoke run: small shapes, few tokens

(a) copy: the bundled default model (real weights) asked to repeat a paragraph, batch 1,
    greedy: decode tokens/s without speculation and with ngram at each k of --ks, the
    acceptance, and whether the output is the same token for token.
(b) batch: the Llama-3.1-8B shape with dummy weights (bench/models.py; --tiny: a small shape),
    --batch sequences of --context random tokens: decode tokens/s without speculation, with
    ngram at the default max_batch_size (the batch is bigger: it falls back to plain
    decoding, which should cost <= 5 %), and with max_batch_size = the batch (forced).

Prints one JSON object (also written to --out).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from bench.engine_bench import start_decoding
from bench.models import LLAMA_31_8B, dummy_model_dir
from pd_cluster import LLM, SamplingParams
from pd_cluster.spec_decode.decoder import SpecStats

TEXT = (
    "The river town wakes before the sun. Fishermen check their nets by lantern light, the "
    "baker pulls the first loaves from a brick oven, and the ferry captain rings a brass bell "
    "twice to tell the far bank that the crossing will start on time. By seven the market "
    "square is full: farmers stack crates of apples and pears, a knife grinder sets up his "
    "wheel beside the fountain, and children carry notes from their parents to the grocer. "
    "At noon the church clock strikes twelve and everyone stops for bread, cheese and a "
    "glass of cold cider. In the afternoon the wind turns, the boats come home, and the town "
    "counts the day's catch on the long stone quay before the lamps are lit again.")
TINY_SHAPE = {**LLAMA_31_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "torch_dtype": "float32"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_device() -> None:
    """After a run's engine is gone (its function returned): give its memory back, so the
    next engine sizes its KV cache from a free GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_request(engine, prompt, params):
    """One request alone: (its final output, decode seconds after its first token)."""
    engine.add_request(prompt, params)
    first, final = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                sync()
                first = time.perf_counter()
            if out.finished:
                final = out
    sync()
    return final, time.perf_counter() - first


def copy_run(model: str, k: int, max_tokens: int, repeats: int, extra: dict):
    """One engine (ngram at k; k = 0: plain): (its row, its tokens, the prompt's length)."""
    spec = {"method": "ngram", "num_speculative_tokens": k} if k else None
    with LLM(model, speculative=spec, **extra) as llm:
        prompt = llm.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}])
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        llm.generate([prompt], params)          # warm-up: every kernel shape compiled
        engine = llm.engine
        if engine.spec is not None:
            engine.spec.stats = SpecStats()     # the timed runs' alone
        runs = [timed_request(engine, prompt, params) for _ in range(repeats)]
        final = runs[0][0]
        tokens = list(final.outputs[0].token_ids)
        rates = sorted((len(tokens) - 1) / s for _, s in runs)
        row = {"k": k, "output_tokens": len(tokens), "decode_tok_s": rates[len(rates) // 2],
               "decode_tok_s_runs": rates}
        if k:
            row["proposed"] = final.spec_proposed_tokens
            row["accepted"] = final.spec_accepted_tokens
            row["acceptance_rate"] = final.spec_accepted_tokens / max(final.spec_proposed_tokens, 1)
            row["engine_stats"] = engine.spec.stats.as_dict()
        else:
            row["text_head"] = final.outputs[0].text[:120]
        return row, tokens, len(prompt)


def copy_case(model: str, ks: list[int], max_tokens: int, repeats: int, extra: dict) -> dict:
    """Batch 1, greedy, a copy-heavy chat prompt: plain vs ngram at each k (the median
    of `repeats` timed runs)."""
    results, reference, prompt_len = [], None, 0
    for k in [0] + ks:
        row, tokens, prompt_len = copy_run(model, k, max_tokens, repeats, extra)
        free_device()
        if k:
            row["same_tokens_as_plain"] = tokens == reference
        else:
            reference = tokens
        results.append(row)
    base = results[0]["decode_tok_s"]
    for row in results[1:]:
        row["speedup"] = row["decode_tok_s"] / base
    return {"prompt_tokens": prompt_len, "max_tokens": max_tokens, "runs": results}


def batch_run(model: str, name: str, spec: dict | None, batch: int, context: int, steps: int,
              extra: dict) -> dict:
    """One engine's decode tokens/s over `steps` steps of `batch` random-token sequences."""
    with LLM(model, load_format="dummy", speculative=spec, **extra) as llm:
        engine = llm.engine
        ids = start_decoding(engine, batch, context, 3, 500, seed=batch * 7 + context)
        before = sum(len(engine.scheduler.requests[i].output_token_ids) for i in ids)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        elapsed = time.perf_counter() - t
        after = sum(len(engine.scheduler.requests[i].output_token_ids) for i in ids)
        row = {"name": name, "running": len(engine.scheduler.running),
               "output_tok_s": (after - before) / elapsed, "step_ms": elapsed / steps * 1e3}
        if spec:
            row["engine_stats"] = engine.spec.stats.as_dict()
        for i in ids:
            engine.abort(i)
        while engine.has_unfinished():
            engine.step()
        return row


def batch_case(model: str, batch: int, context: int, steps: int, extra: dict) -> dict:
    """Decode tokens/s of `batch` random-token sequences: plain, default fallback, forced."""
    runs = []
    for name, spec in [("plain", None), ("ngram_default_fallback", {"method": "ngram"}),
                       ("ngram_forced", {"method": "ngram", "max_batch_size": batch})]:
        runs.append(batch_run(model, name, spec, batch, context, steps, extra))
        free_device()
    base = runs[0]["output_tok_s"]
    for row in runs[1:]:
        row["cost_vs_plain"] = 1 - row["output_tok_s"] / base
    return {"batch": batch, "context": context, "steps": steps, "runs": runs}


def tiny_model_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "pd-cluster-dummy-spec-tiny")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_SHAPE, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes")
    ap.add_argument("--only", default="copy,batch")
    ap.add_argument("--ks", default="3,5,8", help="(a): num_speculative_tokens to try")
    ap.add_argument("--max-tokens", type=int, default=None, help="(a): output tokens")
    ap.add_argument("--repeats", type=int, default=3, help="(a): timed runs per k (median)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    gpu = torch.cuda.is_available()
    res: dict = {"device": torch.cuda.get_device_name() if gpu else "cpu", "tiny": args.tiny}
    if "copy" in parts:
        # Batch 1: CUDA graphs captured up to 16 rows (a verification takes k + 1).
        extra = {"max_num_seqs": 16} if gpu else {"num_kv_blocks": 256}
        res["copy"] = copy_case("default", [int(k) for k in args.ks.split(",")],
                                args.max_tokens or (48 if args.tiny else 320),
                                1 if args.tiny else args.repeats, extra)
    if "batch" in parts:
        model = tiny_model_dir() if args.tiny else dummy_model_dir()
        context = args.context or (64 if args.tiny else 1024)
        extra = dict(max_num_seqs=256, max_num_batched_tokens=16384 if not args.tiny else 2048,
                     max_model_len=4096 if not args.tiny else 512)
        if gpu:
            extra["dtype"] = "bfloat16"
        res["batch"] = batch_case(model, args.batch, context,
                                  args.steps or (4 if args.tiny else 32), extra)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
