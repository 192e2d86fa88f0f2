"""Where the time of a GPU→GPU KV write goes in NIXL, across UCX settings. Prints one JSON object.

    python3 bench/nixl_probe.py --config base --config w4 num_workers=4 \
        --config streams UCX_CUDA_IPC_MAX_STREAMS=32

Each --config NAME [key=value ...] starts a fresh sender/receiver pair of Ray actors (one GPU
each): keys that start with UCX_ or NIXL_ go into both processes' environment, the others are
NIXL UCX backend parameters (num_workers, num_threads, split_batch_size, ...). Per config it
posts raw NIXL requests (the prepared descriptor lists of our transport, no Python bookkeeping)
of a 2048-token Llama-3.1-8B-shaped prompt (256 MiB, 32 layers, block size 16):

- whole / per_layer: one 32-layer request, or 32 one-layer requests posted back to back, each
  with or without a completion notification; ms from the first post to the last DONE;
- per_layer_spaced: one-layer requests posted --gap-ms apart (as a prefill computes layers);
  µs from each post to its DONE, and from the last post to the last DONE;
- NIXL's own telemetry (post and transfer µs, descriptors per request) when available.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import ray
import torch

from pd_cluster.kv_layout import KVLayout
from transfer.nixl_transport import NixlTransport
from transfer.state import Role


class Probe:
    def __init__(self, layout: KVLayout, params: dict[str, str], seed: int, device: str):
        torch.manual_seed(seed)
        self.kv = torch.randn(layout.shape, device=device).to(layout.torch_dtype)
        # A progress thread on both sides (host memory has none by default): nothing else
        # progresses the receiver here.
        self.t = NixlTransport(ucx_params=params, telemetry=True, timeout_s=60.0,
                               progress_thread=True)
        self.t.register(self.kv, layout)
        self.layout = layout

    def descriptor(self) -> bytes:
        return self.t.descriptor().encode()

    def connect(self, desc: bytes) -> str:
        return self.t.connect(desc)

    def _plans(self, peer: str, per_layer: bool):
        blocks = list(range(self.layout.num_blocks))
        L = self.layout.num_layers
        ranges = [range(i, i + 1) for i in range(L)] if per_layer else [range(L)]
        return [self.t._plan(Role.WRITE, self.t.peers[peer], r, blocks, blocks) for r in ranges]

    def _post(self, peer: str, plan, notif: bytes):
        a = self.t.agent
        h = a.make_prepped_xfer("WRITE", self.t._local, plan[0], self.t._remote[peer], plan[1],
                                notif)
        if a.transfer(h) == "ERR":
            raise RuntimeError("NIXL refused the transfer")
        return h

    def _done(self, h, deadline: float) -> bool:
        if time.perf_counter() > deadline:
            raise TimeoutError("a NIXL transfer did not finish in 10 s")
        s = self.t.agent.check_xfer_state(h)
        if s == "ERR":
            raise RuntimeError("NIXL transfer failed")
        return s == "DONE"

    def _telemetry(self, handles) -> dict:
        try:
            tel = [self.t.agent.get_xfer_telemetry(h) for h in handles]
            return dict(post_us=statistics.median(t.postDuration for t in tel),
                        xfer_us=statistics.median(t.xferDuration for t in tel),
                        descs=statistics.median(t.descCount for t in tel))
        except Exception as e:  # noqa: BLE001 - telemetry is optional in NIXL builds
            return dict(telemetry_error=repr(e))

    def burst(self, peer: str, per_layer: bool, notif: bool, rounds: int, warmup: int) -> dict:
        plans, secs, tel = self._plans(peer, per_layer), [], []
        for r in range(warmup + rounds):
            start = time.perf_counter()
            deadline = start + 10.0
            hs = [self._post(peer, p, b"n" if notif else b"") for p in plans]
            pending = list(hs)
            while pending:
                pending = [h for h in pending if not self._done(h, deadline)]
            secs.append(time.perf_counter() - start)
            if r >= warmup:
                tel.append(self._telemetry(hs))
            for h in hs:
                h.release()
        nbytes = self.kv.numel() * self.kv.element_size()
        med = statistics.median(secs[warmup:])
        out = dict(ms_median=round(med * 1e3, 3), gbps_median=round(nbytes / med / 1e9, 1),
                   gbps_best=round(nbytes / min(secs[warmup:]) / 1e9, 1))
        if tel and "post_us" in tel[0]:
            for k in ("post_us", "xfer_us", "descs"):
                out[f"nixl_{k}"] = round(statistics.median(t[k] for t in tel), 1)
        elif tel:
            out.update(tel[0])
        return out

    def spaced(self, peer: str, gap_ms: float, rounds: int, warmup: int) -> dict:
        plans, lat, tail = self._plans(peer, True), [], []
        for r in range(warmup + rounds):
            posted, done, hs = {}, {}, []
            t0 = time.perf_counter()
            deadline = t0 + 10.0 + len(plans) * gap_ms / 1e3
            for i, p in enumerate(plans):
                while time.perf_counter() < t0 + i * gap_ms / 1e3:  # "compute" layer i
                    for j, h in enumerate(hs):
                        if j not in done and self._done(h, deadline):
                            done[j] = time.perf_counter()
                hs.append(self._post(peer, p, b"n"))
                posted[i] = time.perf_counter()
            while len(done) < len(hs):
                for j, h in enumerate(hs):
                    if j not in done and self._done(h, deadline):
                        done[j] = time.perf_counter()
            if r >= warmup:
                lat += [(done[j] - posted[j]) * 1e6 for j in range(len(hs))]
                tail.append((done[len(hs) - 1] - posted[len(hs) - 1]) * 1e6)
            for h in hs:
                h.release()
        return dict(gap_ms=gap_ms, post_to_done_us_median=round(statistics.median(lat), 1),
                    post_to_done_us_p90=round(float(np.percentile(lat, 90)), 1),
                    last_layer_post_to_done_us_median=round(statistics.median(tail), 1))

    def checksum(self) -> int:
        return int(self.kv.view(-1).view(torch.int16).to(torch.int64).sum())

    def close(self) -> None:
        self.t.close()


def probe(layout: KVLayout, name: str, settings: list[str], args) -> dict:
    env = {k: v for k, v in (s.split("=", 1) for s in settings) if k.startswith(("UCX_", "NIXL_"))}
    params = {k: v for k, v in (s.split("=", 1) for s in settings) if k not in env}
    gpus = 1 if args.device == "cuda" else 0
    cls = ray.remote(num_cpus=1, num_gpus=gpus, runtime_env={"env_vars": env})(Probe)
    sender, receiver = (cls.remote(layout, params, s, args.device) for s in (1, 0))
    peer = ray.get(sender.connect.remote(ray.get(receiver.descriptor.remote())))
    ray.get(receiver.connect.remote(ray.get(sender.descriptor.remote())))
    out = dict(name=name, env=env, params=params)
    for key, per_layer, notif in (("whole_notif", False, True), ("whole", False, False),
                                  ("per_layer_notif", True, True), ("per_layer", True, False)):
        out[key] = ray.get(sender.burst.remote(peer, per_layer, notif, args.rounds, args.warmup))
    out["verified"] = ray.get(sender.checksum.remote()) == ray.get(receiver.checksum.remote())
    out["per_layer_spaced"] = ray.get(sender.spaced.remote(peer, args.gap_ms, args.rounds // 2, 2))
    for a in (sender, receiver):
        ray.get(a.close.remote())
        ray.kill(a)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", nargs="+", action="append", metavar="NAME [KEY=VALUE ...]")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gap-ms", type=float, default=1.0)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test")
    args = p.parse_args()
    layout = KVLayout("llama-3.1-8b-shape", "bfloat16", 32, -(-args.tokens // args.block_size),
                      args.block_size, 8, 128)
    ray.init(include_dashboard=False, log_to_driver=False)
    results = dict(tokens=args.tokens, block_size=args.block_size,
                   prompt_kv_bytes=layout.block_bytes * 2 * 32 * layout.num_blocks, configs=[])
    try:
        for name, *settings in args.config or [["base"]]:
            try:
                results["configs"].append(probe(layout, name, settings, args))
            except Exception as e:  # noqa: BLE001 - one bad setting must not lose the others
                results["configs"].append(dict(name=name, error=repr(e)[:500]))
            print(json.dumps(results["configs"][-1]), flush=True)
    finally:
        ray.shutdown()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
