"""EngineLease: an engine actor that nobody renews stops by itself.

The engine actors of a Serve application are detached (router/control/controller.py says
why): they outlive the engine controller's replica, so that a replacement controller adopts
them, KV and requests intact. Nothing then kills them with their owner, so each holds a
lease that its controller renews; a deleted application, or a controller that died and was
never replaced, stops renewing, and the engine ends its own process.

Lifecycle of the lease (one per engine actor, from the end of its constructor):
    HELD      the model is loaded: the lease runs for `lease_s` (ENGINE_LEASE_S as the
              controller starts engines)
    renewed   each `renew()` (the controller's, every ENGINE_LEASE_RENEW_EVERY_S) pushes the
              expiry back; a replacement controller's renewals count the same
    LAPSED    no renewal for `lease_s`: the watchdog thread (not the engine's, which may be
              inside a long step) logs it and has Ray kill the actor, within WATCH_EVERY_S
              more; its requests, KV cache and transport go with it, and Ray frees its name
Not the subscriber lease (actors/subscribers.py), the reservation lease
(actors/engine_actor.py) nor the KV transport's (transfer/state.py).
"""
from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Longer than Serve takes to notice a dead controller replica and start its replacement,
# whose first act is to renew it: a new process importing Ray Serve, 5 s on an idle 2-core
# machine but past 30 s on one whose cores the engines' streams keep busy; short enough that
# the engines of an application deleted while its controller was down do not run on for
# long (a graceful stop kills them at once).
ENGINE_LEASE_S = 60.0
ENGINE_LEASE_RENEW_EVERY_S = 2.0     # how often the controller renews (controller side)
WATCH_EVERY_S = 0.5                  # the watchdog's look at the expiry (its bound's slack)
KILL_WAIT_S = 5.0                    # Ray's kill of the lapsed actor, before it exits itself


class LeaseState(str, enum.Enum):
    HELD = "held"
    LAPSED = "lapsed"


def _end_process() -> None:
    """Ask Ray to kill this actor (an intended exit: its log says so, not a crash), and end
    the process ourselves should that not come within KILL_WAIT_S (no GCS to ask)."""
    try:
        import ray
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(KILL_WAIT_S)
    finally:
        logging.shutdown()
        os._exit(1)


class EngineLease:
    def __init__(self, name: str, lease_s: float = ENGINE_LEASE_S,
                 on_lapse: Callable[[], None] = _end_process) -> None:
        self.name, self.lease_s, self.on_lapse = name, lease_s, on_lapse
        self.state = LeaseState.HELD
        self.renewals = 0
        self._expires = time.monotonic() + lease_s
        self._thread = threading.Thread(target=self._watch, name="engine-lease", daemon=True)
        self._thread.start()

    def renew(self) -> float:
        """Push the expiry back by the lease; returns it (seconds). A lapsed lease stays
        lapsed: the process is on its way out."""
        if self.state is LeaseState.HELD:
            self._expires = time.monotonic() + self.lease_s
            self.renewals += 1
        return self.lease_s

    def left_s(self) -> float:
        return max(0.0, self._expires - time.monotonic())

    def _watch(self) -> None:
        while self.left_s() > 0:
            time.sleep(min(WATCH_EVERY_S, self.left_s()))
        self.state = LeaseState.LAPSED
        logger.error("engine %s: its lease lapsed (no renewal in %g s: its application was "
                     "deleted, or its controller died and none adopted it); stopping",
                     self.name, self.lease_s)
        self.on_lapse()
