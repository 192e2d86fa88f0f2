"""bench/engine_bench.py with decode attention's launcher knobs overridden, for A/B runs of a
launcher rule inside the whole engine (kernel sweeps alone vary by up to 20 % run to run; a
decode step averages 32 layers over many steps).

    DECODE_STAGES=5 DECODE_PPS=7 python bench/engine_knobs.py [engine_bench.py's arguments]

DECODE_STAGES: num_stages of every decode attention launch (kernels/decode_attention.py
defaults: ONE_WARP_STAGES for one-warp programs, else 3). DECODE_PPS: one-warp programs per
SM the split count aims for (FP8_PROGRAMS_PER_SM). DECODE_GEMM_TILES=h200: the FP8 GEMM
tiles that bench/results/fp8_gemm_h200.json and fp8_gemm_stages_h200.json found fastest at
M <= 128 (`h200_tiles`) instead of kernels/fp8_linear.py `tiles`. Unset knobs keep the
launcher's choice.
"""
from __future__ import annotations

import inspect
import os
import runpy
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))
from kernels import decode_attention as da  # noqa: E402
from kernels import fp8_linear  # noqa: E402


def h200_tiles(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages) of the fastest H200 sweep rows for the 8B shapes."""
    if m <= 64:
        if k >= 8192:
            return 32, 256, 8       # down: 19.9 against 20.5 us
        if n >= 16384:
            return 128, 128, 4      # gate_up: 33.4 against 35.0
        return (64, 256, 5) if n >= 6000 else (32, 256, 6)   # qkv 11.1 / 11.5, o 9.0 / 9.2
    if m <= 128:
        if k >= 8192:
            return 64, 256, 5       # down: 23.7 against 25.8
        return (128, 256, 4) if n >= 6000 else (64, 256, 5)  # o: 10.1 against 10.6
    return 128, 256, 4

if "DECODE_STAGES" in os.environ:
    names = [p.name for p in inspect.signature(da.decode_attention).parameters.values()
             if p.default is not inspect.Parameter.empty]
    defaults = list(da.decode_attention.__defaults__)
    defaults[names.index("num_stages")] = int(os.environ["DECODE_STAGES"])
    da.decode_attention.__defaults__ = tuple(defaults)
if "DECODE_PPS" in os.environ:
    da.FP8_PROGRAMS_PER_SM = float(os.environ["DECODE_PPS"])
if os.environ.get("DECODE_GEMM_TILES") == "h200":
    fp8_linear.tiles = h200_tiles
print(f"decode knobs: gemm tiles {os.environ.get('DECODE_GEMM_TILES', 'default')}, stages "
      f"{os.environ.get('DECODE_STAGES', 'default')}, programs per SM {da.FP8_PROGRAMS_PER_SM}",
      file=sys.stderr)
sys.argv = [str(root / "bench/engine_bench.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
