"""An engine's lease (actors/engine_lease.py): renewed, it holds; not renewed, the engine stops
itself within the lease plus the watchdog's period.

- the lease alone: renewals past its length keep it held, and it lapses (its action runs)
  once they stop;
- a real detached, named EngineActor with a 3 s lease: alive while renewed for longer than
  that (1.5 leases), then, with no renewal, its process ends by itself and Ray frees its name.
"""
from __future__ import annotations

import threading
import time

import pytest

from actors.engine_lease import WATCH_EVERY_S, EngineLease, LeaseState
from tests.support.waiting import wait_until

LEASE_S = 1.0
# The lease, the watchdog's look, and a busy 2-core machine's scheduling.
LAPSES_WITHIN_S = LEASE_S + WATCH_EVERY_S + 1.0
ACTOR_LEASE_S = 3.0
ACTOR_STOPS_WITHIN_S = ACTOR_LEASE_S + WATCH_EVERY_S + 5.0   # and Ray seeing the process end


@pytest.mark.slow
def test_renewed_lease_holds_and_an_unrenewed_one_lapses_within_its_length():
    lapsed = threading.Event()
    lease = EngineLease("decode-0", LEASE_S, on_lapse=lapsed.set)
    for _ in range(6):                  # 1.5 lease lengths of renewals
        time.sleep(LEASE_S / 4)
        lease.renew()
    assert lease.state is LeaseState.HELD and not lapsed.is_set()
    stopped = time.monotonic()
    assert lapsed.wait(LAPSES_WITHIN_S)
    took = time.monotonic() - stopped
    assert lease.state is LeaseState.LAPSED and LEASE_S <= took <= LAPSES_WITHIN_S
    assert lease.renew() == LEASE_S and lease.state is LeaseState.LAPSED   # stays lapsed


@pytest.mark.slow
def test_engine_whose_lease_lapses_stops_itself(ray_cluster, tiny_model_root):
    from ray._private.state import actors

    from actors.engine_actor import EngineActor
    from pd_cluster.config import EngineConfig
    from tests.support.tiny_models import make_tiny_model
    ray = ray_cluster
    name = "pd-lease-test-decode-0"
    # A tiny model: the lease is the engine actor's, whatever model it serves.
    config = EngineConfig(model=make_tiny_model("llama_gqa", tiny_model_root), block_size=16,
                          num_kv_blocks=64)
    engine = EngineActor.options(num_cpus=0, name=name, lifetime="detached",
                                 max_restarts=0).remote(config, "decode", 0, "ray", 30.0,
                                                        engine_lease_s=ACTOR_LEASE_S)
    actor_id = engine._actor_id.hex()
    try:
        ray.get(engine.load.remote(), timeout=120)     # the model loaded: the lease runs
        held_until = time.monotonic() + 1.5 * ACTOR_LEASE_S
        while time.monotonic() < held_until:
            assert ray.get(engine.renew_lease.remote(), timeout=10) == ACTOR_LEASE_S
            renewed = time.monotonic()
            time.sleep(ACTOR_LEASE_S / 3)
            assert actors(actor_id=actor_id)["State"] == "ALIVE"
        wait_until(lambda: actors(actor_id=actor_id)["State"] == "DEAD",
                   ACTOR_STOPS_WITHIN_S, 0.2, "the engine dead with its lease lapsed")
        took = time.monotonic() - renewed
        print(f"engine stopped {took:.1f} s after its last renewal (lease {ACTOR_LEASE_S:g} s)")
        assert ACTOR_LEASE_S - 0.5 <= took <= ACTOR_STOPS_WITHIN_S
        with pytest.raises(ValueError):
            ray.get_actor(name)                        # its name is free again
    finally:
        ray.kill(engine)
