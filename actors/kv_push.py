"""Layer-wise KV push from a prefill engine into blocks a decode engine reserved.

The pusher is the prefill engine's `StepListener`. Before a step's forward pass it works out,
for every request with a destination, which of its blocks this step writes; after each layer
it queues that layer's write of those blocks, so the bytes of layer i travel while layer i + 1
computes. On GPU the write waits for a CUDA event recorded after the layer, since kernels run
ahead of the host.

    step k:  L0 ──┬ L1 ──┬ L2 ──┬ ...          (compute, engine thread)
                  └ push L0     └ push L1 ...   (transport pump thread)

Lifecycle of one request's push (`Destination`, keyed by request id in `dests`):
    add                      writes go out as layers are computed (or wait for the
                             destination, `set_destination`)
    finish                   the prefill is done; waiting for every write to land
        ├─► landed           all DONE: `finish`'s future resolves
        └─► abandoned        a write failed, or `abort`: the running writes are aborted
    either way, the request is forgotten and its writes are handed to the transport to drain
    (transfer/drain.py): once none of them can land, the decode side gets DRAINED for the
    request, which frees blocks it fenced for it
The decode side's half of that is `quarantine_late_writes` (its engine's quarantine).
"""
from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.transport_pump import TransportPump
from pd_cluster.scheduler import SchedulerOutput
from transfer.base import KVTransport, Transfer, TransferError
from transfer.drain import member_id

# How long past the writer's transport lease a decode engine keeps the blocks of a dropped
# reservation fenced when no DRAINED comes (the writer died): messages in flight, and a
# writer's pump that is a moment late noticing its abort.
QUARANTINE_MARGIN_S = 1.0


@dataclass(slots=True)
class Destination:
    peer: str | None = None               # the decode engine's transport agent
    remote_blocks: list[int] | None = None  # its blocks for the whole prompt (None: not known yet)
    skip_blocks: int = 0                  # leading blocks it holds already (its prefix hit)
    sent_upto: int = 0                    # prompt tokens whose writes have been issued
    pending: list[tuple] = field(default_factory=list)  # writes waiting for the destination
    transfers: list[Transfer] = field(default_factory=list)
    transfer_ids: list[str] = field(default_factory=list)


class KVPusher:
    def __init__(self, pump: TransportPump, block_size: int, device: torch.device):
        self.pump, self.block_size, self.device = pump, block_size, device
        self.dests: dict[str, Destination] = {}
        self._step_copies: list[tuple[str, int, int, list[int]]] = []
        self._step = 0
        # (what, layer, monotonic time): "computed" after a layer, "posted" when its write starts
        self.timeline: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=4096)

    def add(self, request_id: str, peer: str | None = None,
            remote_blocks: list[int] | None = None, cached_tokens: int = 0) -> None:
        """Push this request's prompt KV; without a destination yet, writes wait for
        `set_destination` (the prefill starts while the decode side is still reserving)."""
        self.dests[request_id] = Destination()
        if remote_blocks is not None:
            self._set(self.dests[request_id], peer, remote_blocks, cached_tokens)

    def set_destination(self, request_id: str, peer: str, remote_blocks: list[int],
                        cached_tokens: int) -> None:
        """The decode side's blocks: issue the writes that waited for them."""
        def apply(tr: KVTransport) -> None:
            d = self.dests.get(request_id)
            if d is not None:
                self._set(d, peer, remote_blocks, cached_tokens)
                for args in d.pending:
                    self._write(tr, request_id, d, *args)
                d.pending.clear()
        self.pump.call(apply)

    def _set(self, d: Destination, peer: str, remote_blocks: list[int], cached: int) -> None:
        d.peer, d.remote_blocks, d.skip_blocks = peer, remote_blocks, cached // self.block_size

    def before_forward(self, plan: SchedulerOutput) -> None:
        self._step += 1
        for req in plan.preempted:  # recomputed from scratch: send everything again
            d = self.dests.get(req.request_id)
            if d is not None:
                d.sent_upto = 0
        bs, copies = self.block_size, []
        for s in plan.scheduled:
            d = self.dests.get(s.request.request_id)
            end = min(s.request.num_computed_tokens + s.num_tokens, s.request.num_prompt_tokens)
            if d is None or end <= d.sent_upto:
                continue
            first, last = d.sent_upto // bs, -(-end // bs)
            copies.append((s.request.request_id, first, last,
                           s.request.block_ids[first:last]))
            d.sent_upto = end
        self._step_copies = copies

    def after_layer(self, layer_idx: int) -> None:
        if not self._step_copies:
            return
        self.timeline.append(("computed", layer_idx, time.monotonic()))
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        copies, step = self._step_copies, self._step
        self.pump.call_after(event, lambda tr: self._post(tr, copies, layer_idx, step))

    def _post(self, tr: KVTransport, copies, layer: int, step: int) -> None:
        self.timeline.append(("posted", layer, time.monotonic()))
        for rid, first, last, local in copies:
            d = self.dests.get(rid)
            if d is None:  # aborted meanwhile
                continue
            if d.remote_blocks is None:
                d.pending.append((layer, step, first, last, local))
            else:
                self._write(tr, rid, d, layer, step, first, last, local)

    @staticmethod
    def _write(tr: KVTransport, rid: str, d: Destination, layer: int, step: int, first: int,
               last: int, local: list[int]) -> None:
        # Blocks the decode side already holds (its prefix hit) are neither sent nor touched.
        skip = max(0, d.skip_blocks - first)
        if first + skip >= last:
            return
        tid = member_id(rid, step, layer)   # the decode side's DRAINED names `rid`
        d.transfers.append(tr.write(d.peer, local[skip:], d.remote_blocks[first + skip:last],
                                    range(layer, layer + 1), tid))
        d.transfer_ids.append(tid)

    def finish(self, request_id: str) -> Future:
        """After the request's last prefill step: resolves (to the transfer ids) when every
        write landed; fails if one failed. Forgets the request either way."""
        def settle(tr: KVTransport) -> Future:
            d = self.dests[request_id]
            if d.remote_blocks is None:
                self._end(tr, request_id, d)
                raise TransferError(f"{request_id}: the decode side never gave a destination")
            done = self.pump.wait_all(d.transfers,
                                      on_end=lambda: self._end(tr, request_id, d))
            out: Future = Future()
            done.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception()
                                   else out.set_result(d.transfer_ids))
            return out
        return _chain(self.pump.call(settle))

    def abort(self, request_id: str) -> None:
        """Stop pushing a request: no more writes go out, those in flight are drained (the
        peer is told of the abort, then DRAINED once none of them can land)."""
        def drop(tr: KVTransport) -> None:
            d = self.dests.get(request_id)
            if d is not None:
                self._end(tr, request_id, d)
        self.pump.call(drop)

    def _end(self, tr: KVTransport, request_id: str, d: Destination) -> None:
        """Forget the request (pump thread) and hand its writes to the transport to drain:
        the decode side gets DRAINED for the request once none of them can land, at once
        when all landed. Also after a success: D may drop the reservation before it sees the
        writes landed (a client gone after the first token), and then the notice frees the
        fenced blocks at once instead of at their deadline. Runs once per Destination: a
        wait that ends after an abort finds it gone."""
        if self.dests.get(request_id) is not d:
            return
        del self.dests[request_id]
        if d.peer is None:   # never had a destination: nothing was posted
            for t in d.transfers:
                tr.release(t)
        else:
            tr.drain(d.peer, request_id, d.transfers)


def _chain(outer: Future) -> Future:
    """Flatten a Future[Future[T]] into a Future[T]."""
    result: Future = Future()

    def inner_done(inner: Future) -> None:
        if inner.exception():
            result.set_exception(inner.exception())
        else:
            result.set_result(inner.result())

    def outer_done(f: Future) -> None:
        if f.exception():
            result.set_exception(f.exception())
        else:
            f.result().add_done_callback(inner_done)

    outer.add_done_callback(outer_done)
    return result


def expect_transfers(pump: TransportPump, peer: str, transfer_ids: list[str]) -> Future:
    """Decode side: a future resolved when every named transfer into our blocks is DONE."""
    def track(tr: KVTransport) -> Future:
        ts = [tr.expect(peer, tid) for tid in transfer_ids]
        return pump.wait_all(ts, on_end=lambda: [tr.release(t) for t in ts])
    return _chain(pump.call(track))


async def quarantine_late_writes(loop: Any, pump: TransportPump) -> None:
    """Decode side of a push (`loop`: the engine's EngineLoop): from now on, the blocks of a
    reservation that ends before its KV landed (abort, lease expiry, a failed transfer) wait
    in the engine's quarantine until the writer's DRAINED for the request, or for the
    transport lease plus QUARANTINE_MARGIN_S, so that no late write reaches a new owner."""
    window = pump.transport.lease_s + QUARANTINE_MARGIN_S
    quarantine = await loop.call(lambda e: e.kv.enable_quarantine(window))
    actor_loop = asyncio.get_running_loop()

    def drained(request_id: str) -> None:   # pump thread
        quarantine.drained(request_id)
        # Most notices come before any hold (every push ends with one) and wait in the
        # quarantine's inbox. One for blocks held now frees them on an engine step, which an
        # idle engine would not take for a while: ask it to settle now. (A racy read of the
        # engine thread's dict, at worst a needless or a missed early wake-up.)
        if request_id in quarantine:
            asyncio.run_coroutine_threadsafe(
                loop.call(lambda e: e.kv.settle_quarantine()), actor_loop)
    await asyncio.wrap_future(pump.call(lambda tr: tr.on_drained(drained)))
