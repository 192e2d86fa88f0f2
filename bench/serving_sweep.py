"""Serving benchmarks through the real HTTP endpoint: `sweep` (goodput against arrival rate,
per configuration) and `validate` (`pd-cluster tune`'s prediction against `pd-cluster bench`).

On nvidia-h200-x2, with Ray Serve and NIXL on PYTHONPATH (`$SITE`: the GPU machines reach no
package index, so their wheels travel unpacked with the run) and a tokenizer directory carried
as .gpucarry/tok, every run starts with

    export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 \
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 && \
      xz -dkf .gpucarry/tok/tokenizer.json.xz && \
      M=$(python3 -m bench.models --tokenizer-from .gpucarry/tok) && \
      S="--set engine.model=$M --set engine.load_format=dummy --set engine.dtype=bfloat16 \
         --set engine.max_model_len=4096"

and goes on with one of these (about 8 minutes each):

    # 1. prompt-heavy sweep, 1P1D and two colocated engines
    python3 -m bench.serving_sweep sweep $S --configs disagg:1:1,colo:2 --rates 4,8,12,16,20 \
      --input-len 2048 --output-len 256 -o $OUT/prompt_heavy 2>&1 | tee $OUT/prompt_heavy.log
    # 2. balanced sweep
    python3 -m bench.serving_sweep sweep $S --configs disagg:1:1,colo:2 --rates 3,6,9,12 \
      --input-len 512 --output-len 512 -o $OUT/balanced 2>&1 | tee $OUT/balanced.log
    # 3. tune's recommendation for 2 GPUs at rate R, measured at R (PROFILE from
    #    `python3 -m pd_cluster.cli profile --model $M --dtype bfloat16 -o PROFILE`, one GPU;
    #    the serving overhead is measured first, on the recommended config, and tune rerun)
    python3 -m bench.serving_sweep validate $S --profile PROFILE --rates R --gpus 2 \
      --serving-overhead-lengths 128,512,1024,2048 \
      --input-len 2048 --output-len 256 -o $OUT/validate 2>&1 | tee $OUT/validate.log

SLOs default to issue 9's: TTFT and TPOT p90 within 1 s and 25 ms. A configuration is
`disagg:P:D` or `colo:N`. Each is served once per command: its own local Ray,
`serve.run(build_app(args))` on a loopback port, args = configs/pd.yaml's with `--set`
overrides; a few unmeasured requests warm it up; then `pd-cluster bench` runs at each rate,
with the router's /metrics scraped around it. The JSON is rewritten after every rate, so a
run cut short keeps what it measured; `--budget-s` (default 470 s) skips rates that would
not fit, and a configuration's higher rates are skipped once its SLO attainment was below
`--stop-below` at two rates in a row. `chart` redraws sweep.png from a sweep.json;
`rejudge` judges a sweep.json's measured requests under other SLOs (e.g. `--tpot-slo 10ms`)
without a new run.
"""
from __future__ import annotations

import sys
from pathlib import Path

from bench.serving_bench import main

ROOT = Path(__file__).resolve().parents[1]

# The benchmarks themselves are bench/harness/sweep.py (and validate.py); serving each
# configuration on a local Ray is bench/serving_bench.py.
if __name__ == "__main__":
    sys.exit(main(None, ROOT / "configs" / "pd.yaml"))
