"""The serving benchmarks' library (bench/serving_sweep.py, served_vs_offline.py,
tp_serving.py, router_overhead.py, kv_tiers_serving.py): serving runs measured with
`pd-cluster bench`, the sweep and validate benchmarks, and the reductions of the engine
actors' stamps and tier counters. Nothing here runs
on its own, and nothing here imports Ray (bench/serving_bench.py is the Ray side)."""
