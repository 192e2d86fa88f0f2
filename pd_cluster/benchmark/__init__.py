"""`pd-cluster bench`: a streaming load generator for any OpenAI-compatible endpoint.

Part of the installed package: the `pd-cluster bench` command (cli.py), one streamed request
timed chunk by chunk (client.py), the load at a rate or a concurrency (loadgen.py) and the
report with goodput under SLOs (metrics.py); `pd-cluster profile-serving` sends its requests
with the same client. The repository's own benchmarks of the engine, kernels, transfer and
serving (bench/, run from a checkout, not installed) use it for their load; their harness is
bench/harness/.
"""
