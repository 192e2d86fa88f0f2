"""Diagnostics for decode attention over an FP8 cache (H100): where the time goes.

    PYTHONPATH=. python bench/attn_diag.py [--occupancy | --parallel | --registers | --rule |
                                            --transposed | --buffers | --chain]

Prints JSON: torch's read bandwidth at the same byte counts, the load-only floor across
contexts (fixed cost per call), the shipped kernel across split counts, and a CUDA-graph
chain of 32 calls (a decode step's attention) against 32 eager calls. --occupancy instead
sweeps the shipped kernel's warps x register cap x stages x tile at four batch shapes;
--parallel sweeps splits x stages x warps x tile (smaller programs, more of them per SM);
--registers caps one-warp programs' registers (192 / 168 / 128) x splits x stages;
--transposed times one-warp programs with the heads as the dots' N dimension (16/32/64-token
tiles x ~7 or ~12 programs per SM) against 4-warp ones, batch 16-256 x context 128-4096;
--chain times each launcher setting as a decode step runs it (32 calls over 32 caches in a
CUDA graph); --buffers times both cache dtypes at num_stages 3/5/7/9 (1/2/3/4 K/V tiles in
flight) and several tile lengths; --rule times the launcher's fp8 choice against the 4-warp
one before it, batch 8-256 x context 128-4096, sized as the engine's CUDA graphs size it
(max_seq_len 4096).
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_fp8_variants import load_only  # noqa: E402
from kernels.decode_attention import (_decode_stage1_kernel, choose_num_splits,  # noqa: E402
                                      decode_attention)

H, KVH, D, BLK = 32, 8, 128, 16
# --parallel's grid (the first H200 sweep, bench/results/attn_diag_parallel_h200.json, also
# tried 4 warps, 64-token tiles and 1 stage: the fastest settings were 1 warp, 32 tokens)
PARALLEL_CASES = ((64, 1024), (128, 1024), (256, 1024), (64, 2048), (128, 2048), (256, 2048))
SPLITS, STAGES, WARPS, TILES = (1, 2, 3, 4), (2, 3, 4), (1, 2), (16, 32)


def cache(batch, context):
    blocks = batch * context // BLK
    k = torch.randn(blocks, BLK, KVH, D, device="cuda").div(0.05).to(torch.float8_e4m3fn)
    v = torch.randn(blocks, BLK, KVH, D, device="cuda").div(0.05).to(torch.float8_e4m3fn)
    table = torch.arange(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    return q, k, v, table, lens


def sweep(cases, grid, scale) -> list[dict]:
    """The shipped fp8 kernel at each (batch, context) case under each knob setting of `grid`:
    a row per pair, with its time or the error of a setting Triton cannot compile."""
    rows = []
    for batch, ctx in cases:
        q, k, v, table, lens = cache(batch, ctx)
        out = torch.empty_like(q)
        for knobs in grid:
            try:
                ms = triton.testing.do_bench(lambda: decode_attention(
                    q, k, v, table, lens, D ** -0.5, ctx, out=out, kv_scale=scale, **knobs))
            except Exception as e:      # a setting Triton cannot compile: say so
                rows.append({"batch": batch, "context": ctx, **knobs, "error": repr(e)[:200]})
                continue
            rows.append({"batch": batch, "context": ctx, **knobs, "us": ms * 1e3,
                         "GBps": 2 * k.numel() / ms / 1e6})
    return rows


def chain_settings(batch: int, sms: int, cap: int) -> list[tuple[str, dict]]:
    """--chain's grid: one-warp transposed programs (tile x stages x programs per SM), two-warp
    ones, and the 4-warp programs (tile x stages), each with its split count."""
    def splits(pps):
        return choose_num_splits(batch * KVH, cap, sms, pps)
    out = [("shipped", {})]
    for bn, st, pps in itertools.product((16, 32, 64), (3, 5, 6, 7), (5, 7)):
        out.append((f"w1_n{bn}_s{st}_p{pps}", dict(num_warps=1, transposed=True, block_n=bn,
                                                  num_stages=st, num_splits=splits(pps))))
    for bn, st in itertools.product((32, 64), (3, 5)):
        out.append((f"w2_n{bn}_s{st}_p7", dict(num_warps=2, transposed=True, block_n=bn,
                                               num_stages=st, num_splits=splits(7))))
    for bn, st in itertools.product((64, 128), (3, 5)):
        out.append((f"w4_n{bn}_s{st}", dict(num_warps=4, transposed=False, block_n=bn,
                                            num_stages=st, num_splits=splits(3.5))))
    return out


def chain_sweep(scale) -> list[dict]:
    """Each setting of `chain_settings` as the engine's decode graphs run attention: 32 calls
    (one a layer, each over its own cache, so nothing stays in L2) captured in one CUDA graph,
    contexts of ctx + 0..63 tokens, splits sized for max_model_len 4096; us per call.
    Single calls vary by up to 20 % from run to run; a graph of 32 averages that out."""
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = 4096
    for batch, ctx in PARALLEL_CASES:
        layers = []
        for _ in range(32):
            q, k, v, table, lens = cache(batch, ctx + 64)
            table = torch.nn.functional.pad(table, (0, cap // BLK - table.shape[1]))
            lens = ctx + torch.randint(0, 64, (batch,), device="cuda", dtype=torch.int32)
            layers.append((q, k, v, table, lens))
        out = torch.empty_like(layers[0][0])
        row = {"batch": batch, "context": ctx, "max_seq_len": cap}
        for name, knobs in chain_settings(batch, sms, cap):
            def step():
                for q, k, v, table, lens in layers:
                    decode_attention(q, k, v, table, lens, D ** -0.5, cap, out=out,
                                     kv_scale=scale, **knobs)
            try:
                step()
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    step()
                    with torch.cuda.graph(g, stream=s):
                        step()
                torch.cuda.synchronize()
                row[name] = round(triton.testing.do_bench(g.replay, rep=200) * 1e3 / 32, 2)
            except Exception as e:      # out of shared memory or registers: say so
                row[name] = repr(e)[:100]
            g = None
        best = min((v, k) for k, v in row.items() if isinstance(v, float))
        row["best"] = best[1]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        layers = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    res = {"device": torch.cuda.get_device_name(), "triton": triton.__version__}
    scale = torch.tensor([0.05, 0.05], device="cuda")
    res["torch_sum"] = []
    for mb in (68, 137, 274, 548):
        buf = torch.empty(mb * 2 ** 20 // 2, device="cuda", dtype=torch.bfloat16).normal_()
        ms = triton.testing.do_bench(lambda: buf.sum())
        res["torch_sum"].append({"MB": mb, "us": ms * 1e3, "GBps": mb * 2 ** 20 / ms / 1e6})
        buf = None
    res["load_only"] = []
    for ctx in (256, 512, 1024, 2048, 4096):
        q, k, v, table, lens = cache(64, ctx)
        words = torch.empty(64 * KVH * 32, dtype=torch.int32, device="cuda")
        for bn in (64, 128):
            ms = triton.testing.do_bench(lambda: load_only(k, v, table, lens, words, block_n=bn))
            res["load_only"].append({"batch": 64, "context": ctx, "block_n": bn, "us": ms * 1e3,
                                     "GBps": 2 * k.numel() / ms / 1e6})
    if "--rule" in sys.argv:    # the launcher's fp8 choice against the one before it
        # As the engine's CUDA graphs launch it: splits sized for max_model_len (4096), not
        # for the step's contexts; each setting timed twice, alternating.
        res["rule"] = []
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        graph_len = 4096
        for batch, ctx in itertools.product((8, 16, 32, 64, 128, 256),
                                            (128, 256, 512, 1024, 2048, 4096)):
            if batch * ctx > 256 * 4096:
                continue
            q, k, v, table, lens = cache(batch, ctx)
            table = torch.nn.functional.pad(table, (0, graph_len // BLK - table.shape[1]))
            out = torch.empty_like(q)
            splits = choose_num_splits(batch * KVH, graph_len, sms)
            before = dict(num_splits=splits, num_warps=4,
                          block_n=128 if batch * KVH * splits > 4 * sms else 64)
            row = {"batch": batch, "context": ctx, "max_seq_len": graph_len, "before": before}
            for name, knobs in (("now", {}), ("before", before)) * 2:
                ms = triton.testing.do_bench(lambda: decode_attention(
                    q, k, v, table, lens, D ** -0.5, graph_len, out=out, kv_scale=scale,
                    **knobs))
                row.setdefault(name + "_us", []).append(ms * 1e3)
            res["rule"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        print(json.dumps(res, indent=1))
        return
    if "--chain" in sys.argv:        # as a decode step runs it: 32 layers in one CUDA graph
        res["chain"] = chain_sweep(scale)
        print(json.dumps(res, indent=1))
        return
    if "--buffers" in sys.argv:      # deeper K/V prefetch: num_stages past the default 3
        # Triton gives a page-table-indexed load (2 ops deep: table, then K/V) one shared-
        # memory buffer at num_stages 2-4, two at 5-6, three at 7-8: the sweeps before tried
        # 2-4 only. Both cache dtypes, as the engine's CUDA graphs launch them (--transposed).
        res["buffers"] = []
        for batch, ctx in PARALLEL_CASES:
            cap = 1024 if ctx <= 1024 else 4096
            q, k, v, table, lens = cache(batch, ctx)
            table = torch.nn.functional.pad(table, (0, cap // BLK - table.shape[1]))
            k16 = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16)
            v16 = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            row = {"batch": batch, "context": ctx, "max_seq_len": cap}
            for (dtype, kk, vv, sc), stages, bn in itertools.product(
                    (("fp8", k, v, scale), ("bf16", k16, v16, None)), (3, 5, 7, 9),
                    (None, 16, 32, 64)):
                if dtype == "bf16" and bn not in (None, 32):
                    continue
                name = f"{dtype}_s{stages}" + (f"_n{bn}" if bn else "")
                try:
                    ms = triton.testing.do_bench(lambda: decode_attention(
                        q, kk, vv, table, lens, D ** -0.5, cap, out=out, kv_scale=sc,
                        num_stages=stages, block_n=bn))
                except Exception as e:      # out of shared memory: say so
                    row[name + "_error"] = repr(e)[:120]
                    continue
                row[name + "_us"] = round(ms * 1e3, 2)
            res["buffers"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        print(json.dumps(res, indent=1))
        return
    if "--parallel" in sys.argv:     # more, smaller programs resident per SM
        res["parallel"] = sweep(PARALLEL_CASES, [{}] + [
            dict(num_splits=sp, num_stages=st, num_warps=w, block_n=bn)
            for sp, st, w, bn in itertools.product(SPLITS, STAGES, WARPS, TILES)], scale)
        print(json.dumps(res, indent=1))
        return
    if "--transposed" in sys.argv:   # one-warp programs with the heads as N, against 4 warps
        # As the engine's CUDA graphs launch it: splits sized for the graph's context cap
        # (1024 for contexts up to 1024 over an fp8 cache, else max_model_len 4096).
        res["transposed"] = []
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for batch, ctx in itertools.product((16, 32, 64, 128, 256),
                                            (128, 256, 512, 1024, 2048, 4096)):
            if batch * ctx > 256 * 4096:
                continue
            cap = 1024 if ctx <= 1024 else 4096
            q, k, v, table, lens = cache(batch, ctx)
            table = torch.nn.functional.pad(table, (0, cap // BLK - table.shape[1]))
            out = torch.empty_like(q)
            four = dict(num_warps=4, transposed=False,
                        num_splits=choose_num_splits(batch * KVH, cap, sms))
            settings = [("shipped", {}), ("four_warps", four)] + [
                (f"t{bn}_pps{pps}", dict(num_warps=1, transposed=True, block_n=bn,
                                         num_splits=choose_num_splits(batch * KVH, cap, sms,
                                                                      pps)))
                for bn, pps in itertools.product((16, 32, 64), (7, 12))]
            row = {"batch": batch, "context": ctx, "max_seq_len": cap}
            for name, knobs in settings:
                ms = triton.testing.do_bench(lambda: decode_attention(
                    q, k, v, table, lens, D ** -0.5, cap, out=out, kv_scale=scale, **knobs))
                row[name + "_us"] = ms * 1e3
            res["transposed"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        print(json.dumps(res, indent=1))
        return
    if "--registers" in sys.argv:    # one-warp programs: a register cap against more per SM
        res["registers"] = sweep(PARALLEL_CASES, [{}] + [
            dict(num_warps=1, block_n=32, maxnreg=r, num_splits=sp, num_stages=st)
            for r, sp, st in itertools.product((None, 192, 168, 128), (1, 2), (2, 3))], scale)
        print(json.dumps(res, indent=1))
        return
    if "--occupancy" in sys.argv:    # registers and warps against programs per SM
        res["occupancy"] = sweep(((64, 1024), (128, 1024), (256, 1024), (64, 2048)), [
            dict(num_warps=w, maxnreg=r, num_stages=st, block_n=bn)
            for w, r, st, bn in itertools.product((2, 4), (None, 128, 96), (2, 3, 4), (64, 128))],
            scale)
        print(json.dumps(res, indent=1))
        return
    res["splits"] = []
    for batch, ctx in ((64, 1024), (128, 1024), (256, 1024), (64, 2048), (128, 2048)):
        q, k, v, table, lens = cache(batch, ctx)
        out = torch.empty_like(q)
        for splits in (None, 1, 2, 3, 4, 6, 8):
            for bn in (64, 128):
                ms = triton.testing.do_bench(lambda: decode_attention(
                    q, k, v, table, lens, D ** -0.5, ctx, out=out, kv_scale=scale,
                    num_splits=splits, block_n=bn))
                res["splits"].append({"batch": batch, "context": ctx, "splits": splits,
                                      "block_n": bn, "us": ms * 1e3,
                                      "GBps": 2 * k.numel() / ms / 1e6})
    # a decode step's 32 attention calls, eager and as one CUDA graph (32 distinct caches,
    # so nothing stays in L2 between calls)
    layers = [cache(64, 1024) for _ in range(32)]
    out = torch.empty_like(layers[0][0])

    def step():
        for q, k, v, table, lens in layers:
            decode_attention(q, k, v, table, lens, D ** -0.5, 1024, out=out, kv_scale=scale)
    step()
    eager = triton.testing.do_bench(step)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()
        with torch.cuda.graph(g, stream=s):
            step()
    torch.cuda.synchronize()
    graphed = triton.testing.do_bench(lambda: g.replay())
    res["chain_64x1024_x32"] = {"eager_us_per_call": eager * 1e3 / 32,
                                "graph_us_per_call": graphed * 1e3 / 32}
    # Triton's code for the shipped kernel: is the K/V loop software-pipelined?
    try:
        kernels = list(_decode_stage1_kernel.device_caches[0][0].items())
    except Exception as e:      # the cache's layout differs across Triton versions
        kernels = []
        res["ttgir_error"] = repr(e)[:200]
    for key, kern in kernels:
        ttgir = kern.asm.get("ttgir", "")
        res.setdefault("ttgir", []).append({
            "async_copy": ttgir.count("async_copy_global_to_local"),
            "tma": ttgir.count("async_tma"), "local_alloc": ttgir.count("local_alloc"),
            "warp_group_dot": ttgir.count("warp_group_dot"), "dot": ttgir.count("tt.dot"),
            "n_regs": getattr(kern, "n_regs", None), "shared": kern.metadata.shared,
            "key": str(key)[:160]})
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
