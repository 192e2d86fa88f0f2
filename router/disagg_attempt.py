"""One attempt at a request in disaggregated serving, as the router sees it: its stage, with the
only legal moves between stages (DisaggregatedClient, router/disagg_client.py, moves it).

Lifecycle of an attempt (`Stage`):

    PREFILLING ──► HANDED_OFF ──► DECODING ──► FINISHED
      │  ↺ ▲           │              ▲
      │    another P   ▼              │
      └──────────► LOCAL_PREFILL ─────┘
    and from any stage before FINISHED: MIGRATED | FAILED | ABORTED

PREFILLING: D reserves blocks for the prompt while P computes it and hands its KV over; if P
dies the prompt goes to another live P (PREFILLING again). HANDED_OFF: the router accepted P's
result: the first token has gone to the caller (not with stop strings: then D's stream
carries it) and D takes the KV over. LOCAL_PREFILL: D prefills the prompt itself: the route
says so (an attempt may start here), D had no room, P failed or none is left (the recompute
policy), or the KV did not land on D. DECODING: the request runs on D, whose stream is the
caller's from here. MIGRATED: D died; the request goes on in a new attempt on another live D,
from the prompt and the tokens already streamed. FAILED: an error went to the caller (the
`fail` policy, no live D left, an engine's error). ABORTED: the caller went away; P and D
were told to abort.

No Ray import: tests drive the stages without engines.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class Stage(enum.Enum):
    PREFILLING = "prefilling"
    HANDED_OFF = "handed_off"
    LOCAL_PREFILL = "local_prefill"
    DECODING = "decoding"
    FINISHED = "finished"
    MIGRATED = "migrated"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def ended(self) -> bool:
        return not TRANSITIONS[self]


_EARLY_END = frozenset({Stage.MIGRATED, Stage.FAILED, Stage.ABORTED})
TRANSITIONS: Mapping[Stage, frozenset[Stage]] = {
    Stage.PREFILLING: frozenset({Stage.PREFILLING, Stage.HANDED_OFF, Stage.LOCAL_PREFILL})
    | _EARLY_END,
    Stage.HANDED_OFF: frozenset({Stage.DECODING, Stage.LOCAL_PREFILL}) | _EARLY_END,
    Stage.LOCAL_PREFILL: frozenset({Stage.DECODING}) | _EARLY_END,
    Stage.DECODING: frozenset({Stage.FINISHED}) | _EARLY_END,
    Stage.FINISHED: frozenset(), Stage.MIGRATED: frozenset(), Stage.FAILED: frozenset(),
    Stage.ABORTED: frozenset(),
}


@dataclass(eq=False, slots=True)
class Attempt:
    """One try of a request on one decode replica (`d`, replica `d_id`): its id on the engines,
    its stage, the prefill replica working on it (`p`, only while it does) and whether the
    caller has its first token from P (`first_sent`: D's stream starts after it)."""

    id: str
    d_id: int
    d: Any                          # D's actor handle
    stage: Stage
    p_id: int | None = None         # the prefill replica it is routed to
    p: Any = None                   # that replica's actor, while it prefills
    first_sent: bool = False
    trace: Any = None               # its request's JobTrace (router/tracing.py), if traced

    @classmethod
    def start(cls, request_id: str, number: int, d_id: int, d: Any,
              p_id: int | None) -> Attempt:
        """Attempt `number` (0 first) at a request: PREFILLING on `p_id`, or LOCAL_PREFILL
        when the route leaves the prefill to D (`p_id` None)."""
        return cls(request_id if number == 0 else f"{request_id}#{number}", d_id, d,
                   Stage.LOCAL_PREFILL if p_id is None else Stage.PREFILLING, p_id)

    def move_to(self, stage: Stage) -> None:
        if stage not in TRANSITIONS[self.stage]:
            raise RuntimeError(f"attempt {self.id}: illegal transition {self.stage.name} -> "
                               f"{stage.name}")
        self.stage = stage
