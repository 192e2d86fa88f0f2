"""What `tune` hands back: a table, a chart of goodput per GPU against P:D, and config snippets
ready to paste into configs/pd.yaml (`applications[0].args`) or the Helm chart's values."""
from __future__ import annotations

import math
from pathlib import Path

from pd_cluster.tuning.search import Candidate
from pd_cluster.tuning.simulator import EngineLimits
from pd_cluster.tuning.slo import SLO


def format_table(results: list[Candidate], slo: SLO, searched_rate: bool) -> str:
    """One row per candidate, best first; the rate column is the max rate when searched."""
    q = f"p{slo.percentile:g}"
    head = ["#", "config", "GPUs", "max rate/s" if searched_rate else "rate/s",
            "goodput/s", "goodput/GPU", "SLO met", f"TTFT {q}", f"TPOT {q}"]
    rows = [[str(i + 1), str(c.spec), str(c.spec.num_gpus), f"{c.rate:.3g}", f"{c.goodput:.3g}",
             f"{c.goodput_per_gpu:.3g}", f"{100 * c.attainment:.1f}%", _ms(c.ttft),
             _ms(c.tpot)] for i, c in enumerate(results)]
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "-" if math.isinf(seconds) else f"{seconds * 1e3:.1f} ms"


CHART_NEEDS = "no chart: matplotlib is not installed (pip install 'pd-cluster[bench]')"


def write_chart(results: list[Candidate], path: str | Path, title: str) -> bool:
    """PNG: goodput per GPU against P/D (log scale); colocated candidates as dashed lines.
    False, and no file, without matplotlib (the `bench` extra): the rest of tune's output
    needs none."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")           # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    disagg = sorted((c for c in results if not c.spec.colocated),
                    key=lambda c: c.spec.num_prefill / c.spec.num_decode)
    ratios = [c.spec.num_prefill / c.spec.num_decode for c in disagg]
    ax.scatter(ratios, [c.goodput_per_gpu for c in disagg], color="tab:blue",
               label="disaggregated P:D")
    for c, x in zip(disagg, ratios):
        ax.annotate(str(c.spec), (x, c.goodput_per_gpu), textcoords="offset points",
                    xytext=(3, 4), fontsize=7)
    colocated = [c for c in results if c.spec.colocated]
    if colocated:
        best_col = max(colocated, key=lambda c: c.goodput_per_gpu)
        ax.axhline(best_col.goodput_per_gpu, color="tab:orange", linestyle="--",
                   label=f"best colocated ({best_col.spec})")
    best = results[0]
    if not best.spec.colocated:
        ax.scatter([best.spec.num_prefill / best.spec.num_decode], [best.goodput_per_gpu],
                   marker="*", s=250, color="tab:red", label=f"recommended ({best.spec})",
                   zorder=3)
    if ratios:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill : decode instances (P / D)")
    ax.set_ylabel("goodput per GPU (requests/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


def serve_args_snippet(best: Candidate, limits: EngineLimits,
                       kv_cache_dtype: str = "auto") -> str:
    """The keys of configs/pd.yaml `applications[0].args` that the recommendation sets (the
    profiled kv_cache_dtype too, when not auto: the KV capacity simulated was its)."""
    mode = "colocated" if best.spec.colocated else "disaggregated"
    kv = [] if kv_cache_dtype == "auto" else [f"  kv_cache_dtype: {kv_cache_dtype}"]
    return "\n".join([
        f"# configs/pd.yaml, applications[0].args: {best.spec}",
        f"mode: {mode}",
        f"num_prefill: {best.spec.num_prefill}",
        f"num_decode: {best.spec.num_decode}",
        "engine:",
        f"  max_num_seqs: {limits.max_num_seqs}",
        f"  max_num_batched_tokens: {limits.max_num_batched_tokens}",
        f"  tensor_parallel_size: {best.spec.gpus_per_instance}",
        *kv,
    ]) + "\n"


def helm_values_snippet(best: Candidate, limits: EngineLimits) -> str:
    """The helm/values.yaml keys that the recommendation sets (colocated: no prefill group)."""
    lines = [f"# helm values: {best.spec}",
             f"mode: {'colocated' if best.spec.colocated else 'disaggregated'}",
             "engine:",
             f"  maxNumSeqs: {limits.max_num_seqs}",
             f"  maxNumBatchedTokens: {limits.max_num_batched_tokens}",
             f"  tensorParallelSize: {best.spec.gpus_per_instance}"]
    gpus = f"  gpusPerReplica: {best.spec.gpus_per_instance}"
    if not best.spec.colocated:
        lines += ["prefill:", f"  replicas: {best.spec.num_prefill}", gpus]
    lines += ["decode:", f"  replicas: {best.spec.num_decode}", gpus]
    return "\n".join(lines) + "\n"
