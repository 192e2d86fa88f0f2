"""Async plumbing of the router: admission with a bounded queue, merging choice streams,
polling the replicas' loads, following the engine controller's membership."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from pd_cluster.role import Role
from router.control.membership import Membership
from router.control.planner_loop import REPORT_EVERY_S
from router.engine_client import EngineClient, answer_within
from router.errors import overloaded
from router.metrics import RouterMetrics
from router.routing import ReplicaLoad, RoutingPolicy

T = TypeVar("T")
RETRY_AFTER_S = 1
# Between two load reports the routing policy adds what it routed itself, so this can be slow.
LOAD_POLL_S = 1.0
# A membership long poll returns at the latest after this (sooner on a change).
MEMBERSHIP_POLL_S = 10.0
logger = logging.getLogger(__name__)


class Admission:
    """Counts engine requests in flight; refuses a request once the engines' running slots
    (`capacity`) and `max_queue` waiting places are all taken, instead of queueing it."""

    def __init__(self, capacity: int, max_queue: int, metrics: RouterMetrics) -> None:
        self.capacity, self.max_queue, self.metrics = capacity, max_queue, metrics
        self.in_flight = 0

    def acquire(self, n: int) -> None:
        """Take `n` places or raise the 429 APIError."""
        if self.in_flight + n > self.capacity + self.max_queue:
            raise overloaded(RETRY_AFTER_S)
        self._set(self.in_flight + n)

    def release(self, n: int) -> None:
        self._set(self.in_flight - n)

    def _set(self, in_flight: int) -> None:
        self.in_flight = in_flight
        self.metrics.in_flight.set(in_flight)
        self.metrics.queued.set(max(0, in_flight - self.capacity))


def merge(streams: Sequence[AsyncIterator[T]], timeout_s: float
          ) -> AsyncIterator[tuple[int, T]]:
    """Items of all `streams` as they come, tagged with the stream's index.

    The first error of any stream is raised; TimeoutError once `timeout_s` have passed in
    all. Leaving early (error, break, cancellation) closes every stream still running, which
    makes them abort their engine requests.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    if len(streams) == 1:   # one prompt, n = 1: the usual request needs no pump task nor queue
        return _single(streams[0], deadline, timeout_s)
    return _interleaved(streams, deadline, timeout_s)


def _left(deadline: float, timeout_s: float) -> float:
    """Seconds left until `deadline` (TimeoutError when none)."""
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise TimeoutError(f"streams did not finish within {timeout_s:g} s")
    return left


async def _single(stream: AsyncIterator[T], deadline: float, timeout_s: float
                  ) -> AsyncIterator[tuple[int, T]]:
    try:
        while True:
            left = _left(deadline, timeout_s)
            try:
                item = await asyncio.wait_for(anext(stream), left)
            except StopAsyncIteration:
                return
            yield 0, item
    finally:
        # A second cancellation (Starlette's cancel scope repeats its own until the request
        # task ends) cuts short wait_for's wait for the step it cancelled: that step, still
        # running, closes the stream itself, and aclose() would raise.
        if not stream.ag_running:
            await stream.aclose()


async def _interleaved(streams: Sequence[AsyncIterator[T]], deadline: float, timeout_s: float
                       ) -> AsyncIterator[tuple[int, T]]:
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, who raises it
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            left = _left(deadline, timeout_s)
            i, item, error = await asyncio.wait_for(queue.get(), left)
            if error is not None:
                raise error
            if item is None:
                running -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class LoadMonitor:
    """Feeds the replicas' load reports to the routing policy and the metrics, every
    LOAD_POLL_S in the background and on demand (a /metrics scrape)."""

    def __init__(self, client: EngineClient, policy: RoutingPolicy,
                 metrics: RouterMetrics) -> None:
        self.client, self.policy, self.metrics = client, policy, metrics
        self._task: asyncio.Task | None = None

    def ensure_started(self) -> None:
        """Start polling on the running event loop (the replica's), once."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def refresh(self) -> list[ReplicaLoad]:
        loads = await self.client.loads(self.policy.prefix_cursors())
        self.policy.set_available(self.client.available())   # it may have found one dead
        self.policy.observe(loads)
        self.metrics.set_loads(loads)
        pool_stats = getattr(getattr(self.client, "handoff", None), "pool_stats", None)
        if pool_stats is not None:   # pooled mode: the KV pools' own counters
            self.metrics.set_kv_pools(await pool_stats())
        return loads

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - keep the last reports, try again later
                logger.warning("load poll failed: %r", e)
            await asyncio.sleep(LOAD_POLL_S)


def serving_change(old: Membership | None, new: Membership,
                   url: str | None) -> tuple[int, str] | None:
    """(log level, line) when requests can first be served, or no longer can; else None."""
    was = old is not None and old.serving()
    tiers = ", ".join(f"{role} {len(new.ready(role))}/{new.targets.get(role, 0)} ready"
                      for role in new.roles())
    if new.serving() and not was:
        return logging.INFO, f"pd-cluster is ready: {url or 'serving'} ({tiers})"
    if was and not new.serving():
        return logging.WARNING, (f"pd-cluster cannot serve now: {tiers}; requests get 503 "
                                 "until a replica of each tier is ready")
    return None


class MembershipWatcher:
    """Keeps this router replica's view of the engines current: long-polls the engine
    controller's membership (router/control/controller.py) and hands each new version to the client
    (which replicas to use), the routing policy (which it may pick), admission (the running
    slots of the READY decode replicas) and the metrics. The other way, with the planner on,
    it reports finished requests' latencies to the controller (router/control/planner_loop.py)."""

    def __init__(self, controller: Any, client: EngineClient, policy: RoutingPolicy,
                 admission: Admission, metrics: RouterMetrics, max_num_seqs: int,
                 url: str | None = None) -> None:
        self.controller, self.client, self.policy = controller, client, policy
        self.admission, self.metrics, self.max_num_seqs = admission, metrics, max_num_seqs
        self.url = url          # said in the line that tells the service serves
        self.membership: Membership | None = None
        self._task: asyncio.Task | None = None
        self._reports: asyncio.Task | None = None
        self._pending: Any = None           # the long poll in flight (a DeploymentResponse)
        self._stopped = False

    def apply(self, membership: Membership) -> None:
        old = self.membership
        if not membership.newer_than(old):
            return
        self.membership = membership
        self.client.update(membership)
        self.sync()
        self.admission.capacity = len(membership.ready(Role.DECODE)) * self.max_num_seqs
        self.metrics.set_membership(membership)
        self._say_serving(old, membership)
        if old is not None:
            # The engine controller logs each change (router/control/fleet.py); every router again
            # would repeat it once per router.
            for m in membership.members:
                was = next((o for o in old.members if o.key == m.key), None)
                if was is None or (was.state, was.actor_id) != (m.state, m.actor_id):
                    logger.debug("engine replica %s-%d: %s%s", m.role, m.replica_id, m.state,
                                 f" ({m.detail})" if m.detail else "")

    def _say_serving(self, old: Membership | None, new: Membership) -> None:
        said = serving_change(old, new, self.url)
        if said is not None:
            logger.log(*said)

    def sync(self) -> None:
        """Tell the policy which replicas the client may use now."""
        self.policy.set_available(self.client.available())

    def ensure_started(self) -> None:
        """Long-poll on the running event loop (the replica's), once; with the planner on,
        also report finished requests' latencies."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._poll())
        if self.metrics.collect_samples and (self._reports is None or self._reports.done()):
            self._reports = loop.create_task(self._report())

    async def _report(self) -> None:
        """Every REPORT_EVERY_S, this router's finished requests (TTFT, TPOT, lengths) go to
        the controller's planner, which answers with its decisions (for /metrics)."""
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            samples = self.metrics.take_samples()
            try:
                self.metrics.set_planner(await answer_within(
                    self.controller.report.remote(samples), MEMBERSHIP_POLL_S))
            except Exception as e:  # noqa: BLE001 - these samples are lost; carry on
                logger.warning("latency report to the planner failed: %r", e)

    def stop(self) -> None:
        """Stop polling and reporting (the router replica stops), and cancel the long poll in
        flight: the controller counts it as ongoing work, so a stopping application would
        otherwise wait it out (up to MEMBERSHIP_POLL_S) before the controller can stop."""
        if self._stopped:
            return
        self._stopped = True
        for task in (self._task, self._reports):
            if task is not None and not task.done():
                task.cancel()
        if self._pending is not None:
            self._pending.cancel()

    async def _poll(self) -> None:
        while True:
            m = self.membership
            try:
                self._pending = self.controller.membership.remote(
                    m.version if m else -1, MEMBERSHIP_POLL_S, m.epoch if m else None)
                self.apply(await self._pending)
            except Exception as e:  # noqa: BLE001 - keep the last view, ask again
                if self._stopped:       # stop() cancelled the poll in flight
                    return
                logger.warning("membership poll failed: %r", e)
                await asyncio.sleep(LOAD_POLL_S)
