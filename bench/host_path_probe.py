"""GPU ↔ pinned-host KV over NIXL between two processes, by who starts the request. Prints JSON.

    python3 bench/host_path_probe.py [--tokens 2048] [--rounds 10]

Two Ray actors on one GPU's host: an engine-like KV cache in GPU memory and a KV-pool-like
one in pinned host memory (a DistributedKVCache's), each a NixlTransport with NIXL's progress
thread. A prompt's blocks (2048 tokens of the Llama-3.1-8B shape: 256 MiB) move four ways:
the GPU side writes to / reads from the host (what DistributedKVCache put / get do today),
and the host side reads from / writes to the GPU. ms per move, median and best, and GB/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pd_cluster.kv_layout import KVLayout  # noqa: E402
from transfer.nixl_transport import NixlTransport  # noqa: E402


class KVMemory:
    def __init__(self, layout: KVLayout, device: str):
        pin = device == "cpu" and torch.cuda.is_available()
        self.kv = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device,
                              pin_memory=pin)
        self.t = NixlTransport(timeout_s=60.0, progress_thread=True)
        self.t.register(self.kv, layout)
        self.blocks = list(range(layout.num_blocks))

    def descriptor(self) -> bytes:
        return self.t.descriptor().encode()

    def connect(self, desc: bytes) -> str:
        return self.t.connect(desc)

    def move(self, peer: str, op: str, rounds: int) -> list[float]:
        """`rounds` WRITEs or READs of every block with `peer`, each waited for; seconds each."""
        out = []
        for _ in range(rounds):
            start = time.perf_counter()
            t = getattr(self.t, op)(peer, self.blocks, self.blocks)
            try:
                self.t.wait(t)
            finally:
                self.t.release(t)
            out.append(time.perf_counter() - start)
        return out

    def drain(self) -> None:
        self.t.progress()   # DONE notices of the peer's requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test")
    args = p.parse_args()
    layout = KVLayout("llama-3.1-8b-shape", "bfloat16", 32, -(-args.tokens // args.block_size),
                      args.block_size, 8, 128)
    nbytes = layout.block_bytes * 2 * layout.num_layers * layout.num_blocks
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        gpu = ray.remote(num_cpus=0, num_gpus=0.5 if args.device == "cuda" else 0)(KVMemory).remote(
            layout, args.device)
        host = ray.remote(num_cpus=0)(KVMemory).remote(layout, "cpu")
        host_name = ray.get(gpu.connect.remote(ray.get(host.descriptor.remote())))
        gpu_name = ray.get(host.connect.remote(ray.get(gpu.descriptor.remote())))
        out = {"tokens": args.tokens, "bytes": nbytes, "device": args.device}
        for name, side, peer, op in (("gpu_writes_host", gpu, host_name, "write"),
                                     ("gpu_reads_host", gpu, host_name, "read"),
                                     ("host_reads_gpu", host, gpu_name, "read"),
                                     ("host_writes_gpu", host, gpu_name, "write")):
            secs = ray.get(side.move.remote(peer, op, args.warmup + args.rounds))[args.warmup:]
            ray.get([gpu.drain.remote(), host.drain.remote()])
            med = statistics.median(secs)
            out[name] = {"ms_median": round(med * 1e3, 2), "ms_best": round(min(secs) * 1e3, 2),
                         "gbps_median": round(nbytes / med / 1e9, 2)}
        print(json.dumps(out, indent=1))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
