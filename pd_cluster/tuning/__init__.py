"""Sizing a cluster: `profile` (measure and fit step latencies), `tune` (simulate and search
prefill:decode counts for the best goodput per GPU under SLOs). No Ray import here."""
