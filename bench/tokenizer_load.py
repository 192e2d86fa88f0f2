"""Seconds to load a model's tokenizer in a new process, as every engine and router replica
does at start: pd_cluster's `load_tokenizer` against `AutoTokenizer.from_pretrained`, each in
--runs fresh Python processes that have imported torch already (an engine has).

    python bench/tokenizer_load.py [--model default] [--runs 5]

Runs on the CPU. Prints JSON: per way, the median and every run's seconds, and the class each
way built.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {
    "load_tokenizer": "from pd_cluster.tokenizer import load_tokenizer; "
                      "cls = type(load_tokenizer(path).hf)",
    "AutoTokenizer": "from transformers import AutoTokenizer; "
                     "cls = type(AutoTokenizer.from_pretrained(path))",
}
CHILD = """import sys, time, torch
path = sys.argv[1]
t = time.perf_counter()
{way}
print(time.perf_counter() - t, cls.__name__)
"""


def one_run(way: str, path: str) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(way=WAYS[way]), path], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    seconds, cls = out.split()
    return float(seconds), cls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a model directory, or 'default'")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pd_cluster.default_model import default_model_path

    path = default_model_path() if args.model == "default" else args.model
    result: dict = {"model": Path(path).name, "cpu": platform.processor() or platform.machine(),
                    "runs": args.runs, "ways": {}}
    for way in WAYS:       # alternated run by run, so that both see the same machine
        result["ways"][way] = {"seconds": [], "class": None}
    for _ in range(args.runs):
        for way in WAYS:
            seconds, cls = one_run(way, path)
            result["ways"][way]["seconds"].append(round(seconds, 3))
            result["ways"][way]["class"] = cls
    for entry in result["ways"].values():
        entry["median_s"] = round(statistics.median(entry["seconds"]), 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
