"""One thread that owns a KV transport: runs commands on it, progresses it, settles waits.

Transports are not thread-safe, and the two-sided ones (ray, ucx) only move bytes while someone
calls `progress()`. So each actor gives its transport to a pump: other threads hand it work
with `call()` (or `call_after(event, ...)`: once a CUDA event has fired, e.g. a layer's KV is
written) and get futures back. Commands run in the order they were given; the pump never
blocks on one: a command whose event has not fired waits at the head of the line while the
pump goes on progressing transfers and settling waits. Blocking on the event would starve
them: under steady prefill load a layer's post is always queued, so a blocking pump would never
get to noticing that earlier writes had landed, and completions would be seen seconds late
(docs/performance.md, "The transport pump").
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from transfer.base import KVTransport, Transfer, TransferError, TransferState

# A pump with no command, wait or transfer for IDLE_AFTER_S polls every IDLE_TICK_S instead of
# every tick: only a peer's unannounced message can then arrive (announced ones: `expect`),
# and it waits at most that long. Polling an idle transport at the busy rate cost an engine
# 6-13% of a core (bench.idle_cpu).
IDLE_AFTER_S = 0.5
IDLE_TICK_S = 10e-3


@dataclass(eq=False)
class _Wait:
    """Resolve `future` once every transfer in `transfers` is DONE (fail on the first failure)."""

    transfers: list[Transfer]
    future: Future
    on_end: Callable[[], None] | None = None
    # Not yet seen DONE, last posted first: writes land about in order, so each check looks
    # at the oldest few instead of every write of the prompt on every poll.
    pending: list[Transfer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending = self.transfers[::-1]


class TransportPump:
    def __init__(self, transport: KVTransport, name: str = "kv-pump", tick_s: float = 1e-3):
        self.transport = transport
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._line: collections.deque = collections.deque()   # (event, fn, future), in order
        self._waits: list[_Wait] = []
        self._tick_s = tick_s
        # Diagnostics: seconds from call() to running, for commands without an event (what a
        # waiter sees), and the longest pump iterations.
        self.call_lag: collections.deque = collections.deque(maxlen=4096)
        self.slow_iterations: collections.deque = collections.deque(maxlen=256)
        self.progress_times: collections.deque = collections.deque(maxlen=4096)
        self._active_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[KVTransport], Any]) -> Future:
        """Run `fn(transport)` on the pump thread; the future holds its result or error."""
        return self.call_after(None, fn)

    def call_after(self, event: Any, fn: Callable[[KVTransport], Any]) -> Future:
        """Like `call`, once `event` (a torch.cuda.Event, or None) has fired."""
        fut: Future = Future()
        self._commands.put((event, fn, fut, time.monotonic()))
        return fut

    def expect(self) -> None:
        """A peer is about to send (P will write into a reservation): poll at the busy rate
        from now on, not at the idle one."""
        self._commands.put((None, None, None, 0.0))     # wakes `_take`, which marks activity

    def stats(self) -> dict:
        """Percentiles of call() → run for event-less commands and of progress + settle, and
        the slowest iterations."""
        return {"calls": len(self.call_lag), **ms_percentiles("call_lag", self.call_lag),
                **ms_percentiles("progress", self.progress_times),
                "line_now": len(self._line),
                "runs_per_request": round(self.transport.posted_runs / self.transport.posted, 1)
                if getattr(self.transport, "posted", 0) else None,
                "slow_iterations_ms": sorted((round(x * 1e3, 1) for x in self.slow_iterations),
                                            reverse=True)[:10]}

    def wait_all(self, transfers: list[Transfer],
                 on_end: Callable[[], None] | None = None) -> Future:
        """A future that resolves when all `transfers` are DONE, or fails with the first failure.

        Call from the pump thread (inside a `call`). `on_end` runs on the pump thread at the
        end either way (e.g. releasing the transfers). Transfers have deadlines, so it ends.
        """
        fut: Future = Future()
        self._waits.append(_Wait(transfers, fut, on_end))
        return fut

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put((None, None, None, 0.0))
        self._thread.join(timeout_s)
        self.transport.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take(self._timeout())
            start = time.monotonic()
            # Every command that is ready, then one progress and one settle: their cost grows
            # with the transfers in flight, so paying it after each command would make a pump
            # that fell behind slower still.
            while self._line:
                event, fn, fut, queued = self._line[0]
                if event is not None and not event.query():
                    break
                self._line.popleft()
                if event is None:
                    self.call_lag.append(time.monotonic() - queued)
                self._execute(fn, fut)
            polled = time.monotonic()
            self.transport.progress()
            self._settle()
            end = time.monotonic()
            self.progress_times.append(end - polled)
            if end - start > 5e-3:
                self.slow_iterations.append(end - start)

    def _timeout(self) -> float:
        """How long to wait for a command: briefly while someone waits on a transfer or a
        command on its event (both are on a TTFT path), longer once the pump has been idle."""
        if self._waits or self._line:
            self._active_at = time.monotonic()
            return self._tick_s / 5
        if self.transport.in_flight():
            self._active_at = time.monotonic()
        elif time.monotonic() - self._active_at > IDLE_AFTER_S:
            return IDLE_TICK_S
        return self._tick_s

    def _take(self, timeout: float) -> None:
        """Move newly given commands into the line (waiting up to `timeout` for the first)."""
        try:
            item = self._commands.get(timeout=timeout)
            self._active_at = time.monotonic()
            while True:
                if item[1] is not None:
                    self._line.append(item)
                item = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _execute(self, fn: Callable, fut: Future) -> None:
        try:
            fut.set_result(fn(self.transport))
        except Exception as e:  # noqa: BLE001 - every error goes to the caller's future
            fut.set_exception(e)

    def _settle(self) -> None:
        for w in list(self._waits):
            while w.pending and w.pending[-1].state is TransferState.DONE:
                w.pending.pop()
            failed = w.pending[-1] if w.pending and w.pending[-1].state.finished else None
            done = not w.pending
            if failed is None and not done:
                continue
            self._waits.remove(w)
            if w.on_end is not None:
                w.on_end()
            if failed is not None:
                w.future.set_exception(TransferError(
                    f"KV transfer {failed.id} with {failed.peer} {failed.state.value}: "
                    f"{failed.error}"))
            else:
                w.future.set_result(time.monotonic())


def ms_percentiles(name: str, seconds) -> dict:
    """{name_p50_ms, name_p90_ms, name_max_ms} of a collection of durations (None if empty)."""
    v = sorted(seconds)
    return {f"{name}_{label}_ms": round(v[int(q * (len(v) - 1))] * 1e3, 2) if v else None
            for label, q in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))}

