"""CPU that an idle KV transport burns: one Ray actor per backend holds a registered transport
and the pump that engines give it (actors/transport_pump.py), and does nothing else. Reported
per backend: CPU seconds per wall second of the actor's process, and of all of the local Ray's
processes (its GCS, raylet, workers: the ray backend's mailbox actor among them) with the
actor and, just before, without it; each over --window seconds.

    python -m bench.idle_cpu [--backends ray,ucx,nixl] [--window 5]

Runs on the CPU (a local Ray of its own). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import psutil
import ray


@ray.remote(num_cpus=0)
class IdleEngine:
    """A transport over a small host KV cache, pumped as an engine pumps it."""

    def __init__(self, backend: str) -> None:
        from actors.transport_pump import TransportPump
        from transfer.base import KVLayout
        from transfer.registry import make_transport

        layout = KVLayout(model="idle", dtype="bfloat16", num_layers=2, num_blocks=32,
                          block_size=4, num_kv_heads=2, head_dim=16)
        transport = make_transport(backend)
        transport.register(layout.allocate(), layout)
        self.pump = TransportPump(transport)

    def pid(self) -> int:
        return os.getpid()


def cpu_seconds(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def session_pids() -> set[int]:
    """Every process of this driver's local Ray: its GCS, raylet, workers and actors."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def cpu_per_s(window_s: float) -> float:
    """CPU seconds per wall second that the session's processes use over the window."""
    pids = session_pids()
    start, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(window_s)
    return (cpu_seconds(pids | session_pids()) - start) / (time.monotonic() - t0)


def measure(backend: str, window_s: float) -> dict:
    idle = cpu_per_s(window_s)
    engine = IdleEngine.remote(backend)
    pid = ray.get(engine.pid.remote())
    time.sleep(1.0)                          # past start-up
    start = cpu_seconds({pid})
    total = cpu_per_s(window_s)
    row = {"backend": backend,
           "engine_process_cpu_per_s": round((cpu_seconds({pid}) - start) / window_s, 3),
           "ray_session_cpu_per_s": round(total, 3),
           "ray_session_cpu_per_s_without_it": round(idle, 3)}
    ray.kill(engine)
    time.sleep(1.0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="ray,ucx,nixl")
    ap.add_argument("--window", type=float, default=5.0)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for backend in args.backends.split(","):
        try:
            rows.append(measure(backend, args.window))
        except Exception as e:  # noqa: BLE001 - a backend not installed here is reported
            rows.append({"backend": backend, "error": repr(e)[:200]})
    print(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
