"""Single-GPU engine speed: decode step vs roofline, prefill tok/s, offline throughput.

    python -m bench.engine_bench [--only decode,prefill,offline] [--hf-offline] [--sync]
        [--batches 64,128,256] [--contexts 1024,2048] [--quantization fp8]
        [--kv-cache-dtype fp8]

(On an 80 GB GPU batch 256 at context 2048 does not fit the KV cache: --batches 64,128.)

Prints one JSON object. Roofline of a decode step = (weight bytes + KV bytes read) / this
machine's measured device copy bandwidth (bytes read + written per second), the bytes those of
the configured dtypes (FP8 linear weights and KV: one byte an element).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

import torch

from bench.models import LLAMA_31_8B, dummy_model_dir, kv_bytes_per_token, params_bytes
from pd_cluster import LLM, SamplingParams


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def token_bound(engine) -> int:
    """The exclusive top of the random prompts' token ids: 120000, or a smaller vocabulary's
    size (DeepSeek-V2's 102400), so that every shape draws the same ids where it can."""
    return min(120000, engine.model_cfg.vocab_size)


def start_decoding(engine, batch: int, context: int, low: int, high: int, seed: int,
                   **params) -> list[str]:
    """`batch` greedy requests of `context` random tokens in [low, high), all prefilled and
    three steps into decoding, the device idle: what a timed decode loop starts from. They
    have room for every token until max_model_len, so none finishes while it is timed
    (prompts are admitted over several prefill steps; the first ones decode meanwhile)."""
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context - 1,
                              ignore_eos=True, **params)
    ids = [engine.add_request([rng.randrange(low, high) for _ in range(context)], sampling)
           for _ in range(batch)]
    while any(engine.scheduler.requests[i].num_computed_tokens < context for i in ids):
        engine.step()
    for _ in range(3):
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return ids


def decode_steps(llm: LLM, batch: int, context: int, steps: int, bw: float,
                 weight_bytes: int, kv_token_bytes: int,
                 timed: contextlib.AbstractContextManager | None = None) -> dict:
    """`timed`: entered around the timed steps alone, its exit after their time is taken
    (bench/tp_bench.py counts the experts they route to)."""
    engine = llm.engine
    ids = start_decoding(engine, batch, context, 1000, token_bound(engine),
                         seed=batch * 7 + context)
    computed = sum(engine.scheduler.requests[i].num_computed_tokens for i in ids)
    with timed or contextlib.nullcontext():
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t) / steps
    running = len(engine.scheduler.running)   # all of them, unless the KV pool ran short
    # KV read per step: the batch's mean context over the timed steps.
    kv_tokens = (computed + sum(engine.scheduler.requests[i].num_computed_tokens
                                for i in ids)) / 2
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    kv = kv_tokens * kv_token_bytes
    roofline = (weight_bytes + kv) / bw
    return {"batch": batch, "running": running, "context": context,
            "mean_context": kv_tokens / batch, "step_ms": step_s * 1e3,
            "roofline_ms": roofline * 1e3, "ratio_to_roofline": step_s / roofline,
            "output_tok_s": batch / step_s}


def prefill(llm: LLM, n: int = 8, length: int = 2048) -> dict:
    engine, rng = llm.engine, random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for rep in range(4):
        for _ in range(n):
            engine.add_request([rng.randrange(1000, token_bound(engine))
                                for _ in range(length)], params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    best = min(times[1:])
    return {"prompts": n, "prompt_len": length, "seconds": best, "tok_s": n * length / best}


def nano_vllm_workload(seed: int = 0, n: int = 256):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 120000) for _ in range(rng.randint(100, 1024))]
               for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, outs


def offline(llm: LLM) -> dict:
    prompts, outs = nano_vllm_workload()
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))  # warm-up
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": dt,
            "output_tok_s": tokens / dt}


def hf_offline(batch: int = 128) -> dict:
    """The same workload through HF generate: length-sorted, left-padded batches."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(dummy_model_dir())
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    prompts, outs = nano_vllm_workload()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    useful, t = 0, time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx], device="cuda")
        mask = (torch.arange(width, device="cuda")[None, :]
                >= torch.tensor([width - len(prompts[i]) for i in idx], device="cuda")[:, None])
        new = max(outs[i] for i in idx)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        useful += sum(outs[i] for i in idx)
    dt = time.perf_counter() - t
    return {"batch": batch, "useful_output_tokens": useful, "seconds": dt,
            "output_tok_s": useful / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,prefill,offline")
    ap.add_argument("--hf-offline", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="64,128,256", help="decode batch sizes")
    ap.add_argument("--contexts", default="1024,2048", help="decode context lengths")
    ap.add_argument("--skip", default="", help="decode cases left out, e.g. 256x2048 (a "
                    "16-bit KV cache of an 80 GB GPU does not hold it)")
    ap.add_argument("--sync", action="store_true", help="async scheduling off (for comparison)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="FP8 weights (quantized at load from the dummy bf16 ones)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = ap.parse_args()
    parts = args.only.split(",")
    res = {"device": torch.cuda.get_device_name(), "model": "llama-3.1-8b shape, dummy bf16",
           "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    weight_bytes = params_bytes(LLAMA_31_8B, 2, 1 if args.quantization == "fp8" else None)
    kv_token_bytes = kv_bytes_per_token(LLAMA_31_8B, 1 if args.kv_cache_dtype == "fp8" else 2)
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    t = time.perf_counter()
    llm = LLM(dummy_model_dir(), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=16384, max_model_len=4096, async_scheduling=not args.sync,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    res["async_scheduling"] = not args.sync
    res["engine_start_s"] = time.perf_counter() - t
    if "decode" in parts:
        skip = set(filter(None, args.skip.split(",")))
        res["decode"] = [decode_steps(llm, int(b), int(c), args.steps, bw, weight_bytes,
                                      kv_token_bytes)
                         for b in args.batches.split(",") for c in args.contexts.split(",")
                         if f"{b}x{c}" not in skip]
    if "prefill" in parts:
        res["prefill"] = prefill(llm)
    if "offline" in parts:
        res["offline"] = offline(llm)
    if args.hf_offline:
        del llm
        torch.cuda.empty_cache()
        res["hf_offline"] = hf_offline()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
