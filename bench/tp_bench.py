"""Tensor parallelism against one GPU, in one run: decode steps, prefill, and where TP's time goes.

    python -m bench.tp_bench [--shape llama-3.1-8b] [--tp 1,2] [--batches 64,128]
        [--context 1024,4096] [--prefill 8x2048] [--quantization fp8] [--kv-cache-dtype fp8]
        [--expert-parallel]

Each TP size runs in a process of its own (one after another, GPUs 0..N-1), and the parent
prints one JSON object: each run's results and, for every size after the first, its ratios to
the first. Per decode batch (the batch prefilled, then `--steps` decode-only steps timed
through `engine.step()` with async scheduling, as bench/engine_bench.py does):
- output tok/s and the step time against its roofline: the bytes one GPU must read a step
  (its share of the weights and of the batch's KV) over the copy rate measured on GPU 0;
- the time rank 0's GPU spends in collectives per step (kernels of the peer all-reduce, and
  NCCL's), from a profile of 8 more steps: it includes waiting for the other ranks; the
  profile's kernel time per step and its top kernels.
Each batch at each `--context` (a comma list: the decode rows' `context`); the profile of
collectives at the first.
Prefill: `--prefill N x L` prompts of random tokens, one output token each, tok/s (the best of
three after a warm-up).

Mixtures of experts (`--shape qwen3-30b-a3b`): a decode step reads only the experts its batch
routes to, so the roofline's weights are the non-expert ones plus, per sparse layer, those
experts (bench/models.py decode_weight_bytes): how many, the model's own counters say (the
distinct experts each timed step routed to, per layer; pd_cluster/models/moe.py), beside the
uniform routing's expectation (`routed_experts_per_layer`; `roofline_expected_ms`). The
counters add four small kernels a layer to every step; `--no-count-experts` leaves them out
(the measured fields are then null and the roofline the expected one).
`--expert-parallel`: the sizes after 1 hold whole experts, E / tp per GPU (the engine's
enable_expert_parallel; attention stays tensor-parallel), their runs and ratios named
"ep<tp>"; each GPU then reads the routed experts among its own.

DeepSeek (`--shape deepseek-v2-lite`): the same MoE roofline over its non-expert bytes
(latent attention, the dense first layer's MLP, shared experts: bench/models.py); its KV
cache is latent, kv_lora_rank + qk_rope_head_dim values a token and layer, whole on every
rank (`kv_bytes_per_token`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.engine_bench import (copy_bandwidth, decode_steps, prefill, start_decoding,
                                token_bound)
from bench.models import (SHAPES, decode_weight_bytes, dummy_model_dir, expected_routed_experts,
                          expert_bytes, is_deepseek, kv_bytes_per_token, moe_layers,
                          num_experts, params_bytes, resident_weight_bytes)

REPO = Path(__file__).resolve().parents[1]

COLLECTIVE_KERNELS = ("push", "one_shot", "two_shot", "nccl")


def collective_ms(llm, batch: int, context: int, steps: int = 8, top: int = 12) -> dict:
    """Rank 0's GPU time per decode step in collective kernels, by kind, and its `top`
    kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    ids = start_decoding(engine, batch, context, 1000, token_bound(engine), seed=batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    kinds: dict[str, float] = {}
    calls: dict[str, float] = {}
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    ranked = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    for e in kernels:
        kind = next((k for k in COLLECTIVE_KERNELS if k in e.key.lower()), None)
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / steps / 1e3
            calls[kind] = calls.get(kind, 0.0) + e.count / steps
    return {"batch": batch, "ms_per_step": kinds, "calls_per_step": calls,
            "total_ms_per_step": sum(kinds.values()),
            "kernel_ms_per_step": sum(e.self_device_time_total for e in kernels) / steps / 1e3,
            "top_kernels": [{"name": e.key[:70], "ms_per_step": e.self_device_time_total
                             / steps / 1e3, "calls_per_step": e.count / steps} for e in ranked]}


def run_one(args) -> dict:
    from pd_cluster import LLM
    from pd_cluster.models.moe import COUNT_ROUTED

    cfg = SHAPES[args.shape]
    fp8_weights, fp8_kv = args.quantization == "fp8", args.kv_cache_dtype == "fp8"
    tp = args.tp_one
    ep = args.expert_parallel and tp > 1
    weight_bytes = params_bytes(cfg, 2, 1 if fp8_weights else None) / tp
    kv_token_bytes = kv_bytes_per_token(cfg, 1 if fp8_kv else 2)
    if not is_deepseek(cfg):        # a rank's KV heads; the latent is whole on each
        kv_token_bytes *= max(1, cfg["num_key_value_heads"] // tp) / cfg["num_key_value_heads"]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in str(args.context).split(",")]
    extra = {k: json.loads(v) for k, v in (e.split("=", 1) for e in args.engine)}
    res = {"engine_args": extra, "tp": tp, "device": torch.cuda.get_device_name(),
           "shape": args.shape,
           "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
           "weight_gb_per_gpu": weight_bytes / 1e9, "kv_bytes_per_token_per_gpu": kv_token_bytes,
           "kv_bytes_per_token": kv_bytes_per_token(cfg, 1 if fp8_kv else 2)}
    if args.expert_parallel:
        res["expert_parallel"] = ep
    if num_experts(cfg):
        res["weight_gb_per_gpu"] = resident_weight_bytes(cfg, tp) / 1e9
        res["moe"] = moe_shape(cfg, tp, ep)
        # Before the model is built (and its graphs): its counters are in every step.
        os.environ[COUNT_ROUTED] = "0" if args.no_count_experts else "1"
    bw = copy_bandwidth()
    res["copy_bandwidth_GBps"] = bw / 1e9
    began = time.perf_counter()
    llm = LLM(dummy_model_dir(args.shape), load_format="dummy", dtype="bfloat16",
              tensor_parallel_size=tp, max_num_seqs=max(batches), max_num_batched_tokens=16384,
              max_model_len=max(max(contexts) + 512, _prefill_len(args) + 16),
              quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype,
              **({"enable_expert_parallel": True} if ep else {}), **extra)
    res["engine_start_s"] = time.perf_counter() - began
    res["peer_all_reduce"] = _peer_on()
    res["decode"] = []
    for c in contexts:
        for b in batches:
            row = (moe_decode_steps(llm, cfg, b, c, args, bw, kv_token_bytes, tp, ep)
                   if num_experts(cfg) else
                   decode_steps(llm, b, c, args.steps, bw, weight_bytes, kv_token_bytes))
            res["decode"].append(row)
            # As it goes (on stderr), so that a run cut short keeps the rows done.
            print(json.dumps({"tp": tp, "decode": row}), file=sys.stderr, flush=True)
    res["collectives"] = [collective_ms(llm, b, contexts[0], top=args.top_kernels)
                          for b in batches]
    if args.prefill:
        n, length = (int(v) for v in args.prefill.split("x"))
        res["prefill"] = prefill(llm, n, length)
    llm.close()
    return res


def moe_shape(cfg: dict, tp: int, ep: bool) -> dict:
    return {"experts": num_experts(cfg), "top_k": cfg["num_experts_per_tok"],
            "sparse_layers": moe_layers(cfg), "expert_mb": expert_bytes(cfg) / 1e6,
            "expert_parallel": ep, "experts_per_gpu": num_experts(cfg) // (tp if ep else 1),
            "non_expert_gb_per_gpu": params_bytes(cfg) / tp / 1e9}


class RoutedExperts:
    """Entered around decode steps: the experts they routed to, from the model's counters
    (pd_cluster/models/moe.py; rank 0's, which see every rank's routing). Per sparse layer
    and step, the distinct experts: in all (`union`) and on the busiest of `ranks` GPUs that
    hold E / ranks whole experts each (`per_gpu`; ranks 1: every GPU reads a slice of all);
    each the mean over steps and layers, the latter the max over ranks first."""

    def __init__(self, model, ranks: int):
        self.model, self.ranks = model, ranks
        self.union = self.per_gpu = self.forwards = None

    def __enter__(self) -> "RoutedExperts":
        from pd_cluster.models.moe import routed_counts

        self._start = routed_counts(self.model)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        from pd_cluster.models.moe import routed_counts

        if exc_type is not None or self._start is None:     # not counting: all None
            return
        delta = (routed_counts(self.model) - self._start).double()
        forwards = delta[:, -1:]
        share = delta[:, :-1] / forwards        # per expert: the share of steps it served
        self.forwards = forwards.mean().item()
        self.union = share.sum(1).mean().item()
        by_rank = share.view(share.shape[0], self.ranks, -1).sum(-1)
        self.per_gpu = by_rank.max(1).values.mean().item()


def moe_decode_steps(llm, cfg: dict, batch: int, context: int, args, bw: float,
                     kv_token_bytes: float, tp: int, ep: bool) -> dict:
    """engine_bench.decode_steps with the MoE roofline (module docstring): its weight bytes
    those of the experts the timed steps routed to, measured; `roofline_expected_ms` with
    uniform routing's expectation instead."""
    routed = RoutedExperts(llm.engine.runner.model, tp if ep else 1)
    expected_bytes = decode_weight_bytes(cfg, batch, tp, ep)
    row = decode_steps(llm, batch, context, args.steps, bw, expected_bytes,
                       kv_token_bytes, timed=routed)
    kv = row["mean_context"] * batch * kv_token_bytes
    weight = decode_weight_bytes(cfg, batch, tp, ep, routed.per_gpu)
    roofline = (weight + kv) / bw
    experts, top_k = num_experts(cfg), cfg["num_experts_per_tok"]
    return {**row, "roofline_ms": roofline * 1e3,
            "ratio_to_roofline": row["step_ms"] / 1e3 / roofline,
            "roofline_expected_ms": row["roofline_ms"], "weight_gb_read_per_gpu": weight / 1e9,
            "kv_gb_read_per_gpu": kv / 1e9,
            "routed_experts_per_layer": {
                "forwards": routed.forwards, "measured": routed.union,
                "expected": expected_routed_experts(experts, top_k, batch),
                "measured_per_gpu": routed.per_gpu,
                "expected_per_gpu": expected_routed_experts(
                    experts, top_k, batch, experts // tp if ep else None)}}


def _prefill_len(args) -> int:
    return int(args.prefill.split("x")[1]) if args.prefill else 0


def _peer_on() -> bool:
    from pd_cluster.distributed import get_tp

    return get_tp().peer is not None


def ratios(base: dict, run: dict) -> dict:
    contexts = {row["context"] for row in base["decode"]}

    def name(row: dict) -> str:     # the context named when there are several
        return f"decode_b{row['batch']}" + (f"_c{row['context']}" if len(contexts) > 1 else "")

    out = {f"{name(a)}_tok_s": b["output_tok_s"] / a["output_tok_s"]
           for a, b in zip(base["decode"], run["decode"])}
    if "prefill" in base and "prefill" in run:
        out["prefill_tok_s"] = run["prefill"]["tok_s"] / base["prefill"]["tok_s"]
    return out


def label(run: dict) -> str:
    """A run's name: its TP size, "ep<size>" under expert parallelism."""
    return f"ep{run['tp']}" if run.get("expert_parallel") else str(run["tp"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tp", default="1,2", help="TP sizes, run one after another")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", default="1024", help="contexts, each batch at each")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top-kernels", type=int, default=12,
                    help="kernels listed per batch, by GPU time per step")
    ap.add_argument("--prefill", default="8x2048", help="N x L, or empty for none")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--engine", action="append", default=[], metavar="FIELD=JSON",
                    help="another EngineConfig field, e.g. peer_all_reduce=false")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="MoE shapes: sizes after 1 hold whole experts (enable_expert_parallel)")
    ap.add_argument("--no-count-experts", action="store_true",
                    help="MoE shapes: no routed-expert counters (four small kernels a layer); "
                         "the roofline then takes uniform routing's expected experts")
    ap.add_argument("--tp-one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if num_experts(SHAPES[args.shape]) and args.quantization:
        ap.error(f"{args.shape}: FP8 experts are not supported yet")
    if args.expert_parallel and not num_experts(SHAPES[args.shape]):
        ap.error(f"--expert-parallel: {args.shape} has no experts")
    if args.tp_one is not None:
        print(json.dumps(run_one(args)))
        return
    runs = []
    for tp in args.tp.split(","):
        argv = [a for a in sys.argv[1:]] + ["--tp-one", tp]
        # Each size in a process of its own, this module run by name with the repository
        # root importable however this one was started (`-m` or the file with PYTHONPATH).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        done = subprocess.run([sys.executable, "-m", "bench.tp_bench", *argv], env=env,
                              capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"tp={tp} failed ({done.returncode})")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        # As it goes, so that a run cut short keeps the sizes done.
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result = {"runs": runs,
              "ratios_to_first": {label(r): ratios(runs[0], r) for r in runs[1:]}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
