"""The product's benchmarks, run from a checkout of this repository (not installed with the
package): `python -m bench.<name>` from the repository root, or `python bench/<name>.py`
with the repository root on PYTHONPATH. bench/README.md lists them; bench/harness/ is the
serving benchmarks' library; bench/results/ holds the recorded results that the docs cite,
indexed by `python -m bench.results_index`.

`pd-cluster bench` (pd_cluster/benchmark/) is different: the load generator shipped in the
package, for load-testing any OpenAI-compatible endpoint.
"""
