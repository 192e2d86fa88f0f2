"""bench/engine_bench.py with decode attention's launcher knobs overridden, for A/B runs of a
launcher rule inside the whole engine (kernel sweeps alone vary by up to 20 % run to run; a
decode step averages 32 layers over many steps).

    DECODE_STAGES=5 DECODE_PPS=7 python bench/engine_knobs.py [engine_bench.py's arguments]

DECODE_STAGES: num_stages of every decode attention launch (kernels/decode_attention.py
defaults: ONE_WARP_STAGES for one-warp programs, else 3). DECODE_PPS: one-warp programs per
SM the split count aims for (FP8_PROGRAMS_PER_SM). Unset knobs keep the launcher's choice.
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

if "DECODE_STAGES" in os.environ:
    names = [p.name for p in inspect.signature(da.decode_attention).parameters.values()
             if p.default is not inspect.Parameter.empty]
    defaults = list(da.decode_attention.__defaults__)
    defaults[names.index("num_stages")] = int(os.environ["DECODE_STAGES"])
    da.decode_attention.__defaults__ = tuple(defaults)
if "DECODE_PPS" in os.environ:
    da.FP8_PROGRAMS_PER_SM = float(os.environ["DECODE_PPS"])
print(f"decode knobs: stages {os.environ.get('DECODE_STAGES', 'default')}, programs per SM "
      f"{da.FP8_PROGRAMS_PER_SM}", file=sys.stderr)
sys.argv = [str(root / "bench/engine_bench.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
