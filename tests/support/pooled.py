"""Pooled mode's client over real Ray actors (P -> DistributedKVCache -> D), small enough for a
CPU."""
from __future__ import annotations

import asyncio

import ray

from router.app import start_client  # noqa: E402
from router.app_config import AppConfig  # noqa: E402

OPTIONS = {"prefill": {"num_cpus": 0}, "decode": {"num_cpus": 0}}


def start(model_dir: str, transport: str, num_decode: int = 1, num_prefill: int = 1,
          shared_memory: bool | None = None):
    # Small KV caches (8 sequences of 512 tokens) keep the engines and the KV pool light.
    # By default nixl engines copy through the pool's shared memory (all on its node); ucx
    # and ray: the blocks go through the transport.
    if shared_memory is None:
        shared_memory = transport == "nixl"
    config = AppConfig.from_args({"mode": "pooled", "transport": transport,
                                  "num_prefill": num_prefill, "num_decode": num_decode,
                                  "kv_pool": {"shared_memory": shared_memory},
                                  "engine": {"model": model_dir, "max_model_len": 512,
                                             "max_num_seqs": 8},
                                  "limits": {"request_timeout_s": 30, "max_tokens": 400}})
    client = start_client(config, config.engine, OPTIONS)
    asyncio.run(client.wait_ready(120))
    return client


def shutdown(client) -> None:
    for a in [*client.prefill, *client.decode, client.handoff.pool]:
        ray.kill(a)
