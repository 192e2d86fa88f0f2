"""Totals of an engine's steps by kind: how many, how long, and the work in them, in the
terms of the profile's latency models (`pd_cluster.tuning.profile`), so that a server's
served step time can be set against a profile: the sum of a linear model's predictions over
many steps is the model applied to the summed features.

    prefill steps: sum_tokens (chunk tokens), sum_sq_tokens (attention work of a chunk of c
                   tokens after p computed ones: (p + c)^2 - p^2, as the simulator counts it)
    decode steps:  sum_ctx (tokens attended), batch (sequences)
    mixed steps:   both
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from pd_cluster.scheduler import SchedulerOutput


STEP_FEATURES = ("sum_tokens", "sum_sq_tokens", "sum_ctx", "batch")


class StepKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(slots=True)
class StepWork:
    sum_tokens: int = 0
    sum_sq_tokens: int = 0
    sum_ctx: int = 0
    batch: int = 0

    @property
    def kind(self) -> StepKind:
        if self.batch and self.sum_tokens:
            return StepKind.MIXED
        return StepKind.DECODE if self.batch else StepKind.PREFILL

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepWork:
        """The work of a planned step (before it is launched: `num_computed_tokens` is what
        each request had computed before this step)."""
        work = cls()
        for s in plan.scheduled:
            req, c = s.request, s.num_tokens
            p = req.num_computed_tokens
            if (c == 1 or s.draft) and p >= req.num_prompt_tokens:
                # One new token of a sequence (speculating: its k drafts too).
                work.batch += 1
                work.sum_ctx += p + c
            else:                                           # a chunk of a prompt (or recompute)
                work.sum_tokens += c
                work.sum_sq_tokens += c * (2 * p + c)
        return work


@dataclass(slots=True)
class StepTotals:
    steps: int = 0
    seconds: float = 0.0
    work: StepWork = dataclasses.field(default_factory=StepWork)

    def add(self, work: StepWork, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        for f in dataclasses.fields(StepWork):
            setattr(self.work, f.name, getattr(self.work, f.name) + getattr(work, f.name))

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "seconds": self.seconds, **dataclasses.asdict(self.work)}


def new_totals() -> dict[str, StepTotals]:
    return {kind.value: StepTotals() for kind in StepKind}
