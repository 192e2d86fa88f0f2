"""Disaggregated serving with tensor-parallel engines, through HTTP: greedy parity and latency.

    python -m bench.tp_serving [--shape llama-3.1-8b] [--configs p2d2,p1d2,colo2]
        [--rate 2] [-n 40] [--input-len 2048] [--output-len 256] -o OUT.json

Serves each configuration in turn on a private local Ray (bench/serving_bench.py `serving`,
configs/pd.yaml's args with the dummy model of `--shape` and a word-level tokenizer of its
vocabulary, bench/models.py):

    p2d2   1 prefill replica at tp=2  -> 1 decode replica at tp=2   (4 GPUs)
    p1d2   1 prefill replica at tp=1  -> 1 decode replica at tp=2   (3 GPUs)
    colo2  1 colocated engine at tp=2                               (2 GPUs)

and for each: the same greedy prompts (long enough to be prefilled on P) through
/v1/completions, their texts compared with colo2's; then `pd-cluster bench` at `--rate`
(Poisson) for `-n` requests: TTFT and TPOT p50 / p90. Prints JSON (and writes it to -o).
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from bench.harness.serving_runs import app_args, bench
from bench.models import SHAPES, dummy_model_dir, word_tokenizer
from bench.serving_bench import serving
from pd_cluster.benchmark.loadgen import make_prompt

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "p2d2": {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1,
             "prefill_tensor_parallel_size": 2, "decode_tensor_parallel_size": 2},
    "p1d2": {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1,
             "prefill_tensor_parallel_size": 1, "decode_tensor_parallel_size": 2},
    "colo2": {"mode": "colocated", "num_prefill": 0, "num_decode": 1,
              "decode_tensor_parallel_size": 2},
}


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{e.code}: {e.read().decode()[:500]}") from None


def latency(report: dict) -> dict:
    ok = [r for r in report["records"] if r["ok"]]
    ttft = np.array([r["ttft"] for r in ok])
    tpot = np.array([r["tpot"] for r in ok if r.get("tpot") is not None])
    pct = lambda a, q: float(np.percentile(a, q)) * 1e3 if a.size else None  # noqa: E731
    return {"requests": len(report["records"]), "ok": len(ok),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p90": pct(ttft, 90),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p90": pct(tpot, 90)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--configs", default="p2d2,p1d2,colo2")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--input-len", default="2048")
    ap.add_argument("--output-len", default="256")
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--parity-words", default="300,700,1500,64,1100,250",
                    help="the greedy prompts' lengths in words (about tokens)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("-o", "--output", required=True)
    opts = ap.parse_args()
    opts.num_cpus = opts.num_gpus = None
    opts.ttft_slo, opts.tpot_slo, opts.slo_percentile, opts.timeout = "1s", "25ms", "p90", 60.0
    model = dummy_model_dir(opts.shape, word_tokenizer(
        str(Path(dummy_model_dir(opts.shape)).with_name("pd-cluster-word-tokenizer")),
        SHAPES[opts.shape]["vocab_size"]))
    rng = np.random.default_rng(7)
    prompts = [make_prompt(int(n), rng) for n in opts.parity_words.split(",")]
    base = app_args([f"engine.model={model}", "engine.load_format=dummy",
                     "engine.dtype=bfloat16", "engine.max_model_len=4096", *opts.set],
                    REPO / "configs" / "pd.yaml")
    result = {"shape": opts.shape, "rate": opts.rate, "requests": opts.n,
              "input_len": opts.input_len, "output_len": opts.output_len, "configs": {}}
    for name in opts.configs.split(","):
        began = time.monotonic()
        with serving({**base, **CONFIGS[name]}, opts) as url:
            row = {"start_s": time.monotonic() - began}
            row["texts"] = [complete(url, model, p, opts.parity_tokens) for p in prompts]
            row.update(latency(bench(url, opts, ["--rate", str(opts.rate)], opts.n, seed=11)))
        result["configs"][name] = row
        Path(opts.output).write_text(json.dumps(result, indent=1))
    ref = result["configs"].get("colo2", {}).get("texts")
    for name, row in result["configs"].items():
        row["greedy_equal_to_colo2"] = None if ref is None else row["texts"] == ref
    Path(opts.output).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: {f: v for f, v in row.items() if f != "texts"}
                      for k, row in result["configs"].items()}, indent=1))


if __name__ == "__main__":
    main()
