"""Ranks 1..N-1 of a tensor-parallel engine: child processes that mirror rank 0's steps.

Rank 0 is the engine's own process: it schedules, prepares each step's inputs on the host and
samples. Every rank holds its share of the weights and of the KV heads (pd_cluster/distributed.py,
pd_cluster/models/). Per step (ModelRunner.execute on rank 0, ModelRunner.follow on the others):

    rank 0                                        rank r
    channel.send(StepInputs)  (shared memory) ───► channel.receive: the same inputs
    forward: an all_reduce per row-parallel layer ◄──► the same (a CUDA graph for decodes)
    logits of the sampling rows: an all_gather    ◄──► the same
    sample; broadcast_tensor(tokens)     ───────► keeps them (a later step's input tokens)
    ...
    channel.send(None)                   ───────► leaves the loop, exits (shutdown)

Lifecycle: `RankWorkers.start` spawns the N-1 processes ('spawn': no forked CUDA context or
threads); each joins the group and builds its runner while rank 0 joins and builds its own
(the rendezvous and the KV cache sizing are collectives, so all ranks must get there, within
`timeout_s`). `close` tells the workers to exit and reaps them. A rank that dies breaks the
next collective on the others (the transport reports the closed peer, at the latest the
group's timeout): rank 0's step raises and the engine fails its requests, never hangs; a
worker whose parent died exits (it checks every second).

The runner's class is rank 0's to hand in (`make_runner`): this module only supervises the
processes, and the runner, which starts them, imports it, never the reverse.

The children run `_worker_main` alone: they do not re-run the script that built the engine
(multiprocessing's 'spawn' would import it again as `__mp_main__`, so a script without an
`if __name__ == "__main__":` guard would start the engine again in every child).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import types
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.multiprocessing as mp

from pd_cluster.distributed import destroy_tp, init_tp
from pd_cluster.startup_heap import freeze_startup_heap
from pd_cluster.step_channel import GPU_SPIN_S, StepChannel

logger = logging.getLogger(__name__)

# Rendezvous and every collective of the group give up after this (a dead rank, at worst).
GROUP_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 30.0
PARENT_CHECK_S = 1.0


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class RankRunner(Protocol):
    """What a rank's process builds: its KV cache (handed to rank 0) and the step loop."""

    kv_cache: torch.Tensor

    def follow(self, channel: StepChannel) -> None: ...


class RankWorkers:
    """The child processes of ranks 1..size-1; rank 0 (the caller) joins with `init_method`.

    Each child builds `make_runner(*runner_args, rank=rank)`: `make_runner` travels to it
    pickled by reference, so it must be a module-level class or function (a child imports its
    module, never the parent's script), and runner_args[0] is the engine's EngineConfig (its
    `torch_device(rank)` is the rank's device)."""

    def __init__(self, size: int, make_runner: Callable[..., RankRunner], runner_args: tuple,
                 channel_path: str, timeout_s: float = GROUP_TIMEOUT_S):
        self.size, self.runner_args, self.timeout_s = size, runner_args, timeout_s
        self.make_runner = make_runner
        self.channel_path = channel_path
        self.init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.procs: list[Any] = []
        self._kv_queue: Any = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._kv_queue = ctx.Queue()
        for rank in range(1, self.size):
            proc = ctx.Process(target=_worker_main, name=f"pd-tp-rank-{rank}", daemon=True,
                               args=(rank, self.size, self.init_method, self.timeout_s,
                                     os.getpid(), self.make_runner, self.runner_args,
                                     self._kv_queue, self.channel_path))
            with _main_module_hidden():
                proc.start()
            self.procs.append(proc)

    def kv_caches(self) -> dict[int, Any]:
        """Every worker's KV cache tensor, mapped into this process (shared memory on a CPU,
        CUDA IPC on a GPU): the engine's transport reads and writes all ranks' KV from here.
        Each worker sends it once its runner is built."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < self.size - 1:
            left = deadline - time.monotonic()
            if left <= 0 or self.dead():
                raise RuntimeError(f"tensor-parallel ranks {sorted(set(range(1, self.size)) - set(got))} "
                                   f"did not share their KV cache (dead: {self.dead()})")
            try:
                rank, kv = self._kv_queue.get(timeout=min(left, PARENT_CHECK_S))
            except Exception:  # noqa: BLE001 - queue.Empty: look again (and at the ranks)
                continue
            got[rank] = kv
        return got

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [rank for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]

    def close(self) -> None:
        """Reap the workers (after rank 0 told them to stop, or gave up on them)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        self.procs = []


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While a child is spawned: a `__main__` without a file or spec, so the child does not
    import the parent's script (it needs nothing from it: its target lives here, and
    `make_runner` in the module that defines it)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _worker_main(rank: int, size: int, init_method: str, timeout_s: float, parent: int,
                 make_runner: Callable[..., RankRunner], runner_args: tuple, kv_queue: Any,
                 channel_path: str) -> None:
    """A rank's process: join the group, build the model runner, hand rank 0 its KV cache,
    mirror rank 0's steps."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    config = runner_args[0]
    device = config.torch_device(rank)
    channel = StepChannel.attach(channel_path, size - 1,     # before rank 0 unlinks it
                                 spin_s=GPU_SPIN_S if device.type == "cuda" else 0.0)
    if device.type == "cuda":
        torch.cuda.set_device(device)       # NCCL binds the rank to the current device
    init_tp(rank, size, init_method, backend_for(device.type), timeout_s)
    try:
        runner = make_runner(*runner_args, rank=rank)
        kv_queue.put((rank, runner.kv_cache))
        if device.type == "cuda":
            freeze_startup_heap()   # as rank 0 does: no collection walks the model mid-step
        runner.follow(channel)
    except Exception:  # noqa: BLE001 - rank 0 sees the broken collective; say why here
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    destroy_tp()


def _exit_with_parent(parent: int) -> None:
    # A worker blocked in a collective would notice a dead rank 0 only at the group's timeout.
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)
