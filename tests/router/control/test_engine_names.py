"""Engines by name (router/control/engines.py) and their adoption (EngineFleet.take_over), as
data: which names are one application's, and the slots a replacement controller makes of the
engines it finds (the real adoption under `serve run`:
tests/router/control/test_control_plane.py)."""
from __future__ import annotations

from actors.messages import ReplicaLoad
from pd_cluster.role import Role
from router.control.engines import RunningEngine, _of_app, engine_name
from router.control.fleet import EngineFleet
from router.control.membership import ReplicaState


def test_names_say_application_role_and_replica_and_match_only_their_application():
    assert engine_name("pd", Role.PREFILL, 0) == "pd-pd-prefill-0"
    assert _of_app("pd-pd-decode-12", "pd") and _of_app("pd-pd-decode-1-3fa9c0", "pd")
    # An application's name may hold dashes; another application's engines never match.
    assert _of_app("pd-a-b-prefill-0", "a-b") and not _of_app("pd-a-b-prefill-0", "a")
    assert not _of_app("pd-pd-pd-decode-0", "pd") and _of_app("pd-pd-pd-decode-0", "pd-pd")
    assert not _of_app("pd-pd-router-0", "pd") and not _of_app("pd-pd-decode-x", "pd")


def running(role: Role, replica_id: int, joined: bool = True) -> RunningEngine:
    return RunningEngine(f"pd-pd-{role}-{replica_id}", object(), f"id-{role}-{replica_id}",
                         ReplicaLoad(role, replica_id), b"kv" if joined else None)


def test_found_engines_keep_their_slots_and_only_the_shortfall_gets_new_ones():
    fleet = EngineFleet("disaggregated", {Role.PREFILL: 1, Role.DECODE: 2}, handoff=object(),
                        resources={})
    # The planner had added decode-3; decode-0 and decode-1 are gone; prefill-0 had not
    # joined the handoff yet when its controller died.
    fleet.take_over([running(Role.PREFILL, 0, joined=False), running(Role.DECODE, 3)])
    slots = {f"{role}-{i}": s for (role, i), s in fleet.slots.items()}
    assert sorted(slots) == ["decode-3", "decode-4", "prefill-0"]
    assert slots["decode-3"].state is ReplicaState.READY
    assert slots["decode-3"].actor_id == "id-decode-3" and slots["decode-3"].descriptor == b"kv"
    assert slots["prefill-0"].state is ReplicaState.PENDING     # brought up, then joined
    assert slots["prefill-0"].actor is not None and slots["decode-4"].actor is None
    assert fleet.targets == {Role.PREFILL: 1, Role.DECODE: 2}
