"""router/placement.py against a real Ray: an actor whose constructor is still running is
placed (the fleet says "starting", not "not placed"); one asking for more than any node has
is not, and the reason names what it asks for and what the largest node offers."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
from tests.support.waiting import wait_until  # noqa: E402


def test_an_actor_still_constructing_is_placed_and_an_oversized_one_is_not(ray_cluster):
    from router.control.placement import ray_actor_placed, unplaced_reason
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Slow:
        def __init__(self, hold_s: float) -> None:
            time.sleep(hold_s)

        def ping(self) -> bool:
            return True

    constructing = Slow.remote(20.0)
    oversized = Slow.options(num_cpus=64).remote(0.0)
    try:
        wait_until(lambda: ray_actor_placed(constructing._actor_id.hex()), 30, 0.2,
                   "the constructing actor placed")
        # Its constructor still runs: Ray calls it PENDING_CREATION, yet it has its worker.
        done, _ = ray.wait([constructing.ping.remote()], timeout=0.1)
        assert not done
        assert not ray_actor_placed(oversized._actor_id.hex())
        reason = unplaced_reason({"num_cpus": 64})
        assert reason.startswith("asks for {CPU: 64}: no node of the cluster has that much")
    finally:
        for actor in (constructing, oversized):
            ray.kill(actor)
