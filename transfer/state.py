"""What one transfer is, as either side sees it, and how it can end (see transfer/base.py)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

# How long a transfer's peer may stay silent (no renewal) before the transfer expires; a
# receiver also fences the blocks a dead sender may still write for this long (plus a margin).
LEASE_S = 10.0


class TransferError(RuntimeError):
    """A transfer did not complete; the message says why and with which peer."""


class LayoutMismatchError(TransferError):
    """Two KV caches whose blocks cannot be exchanged (different model, dtype, shape, backend)."""


class TransferState(Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"
    EXPIRED = "expired"

    @property
    def finished(self) -> bool:
        return self is not TransferState.IN_FLIGHT


class Role(Enum):
    WRITE = "write"    # we push our blocks into the peer's
    READ = "read"      # we pull the peer's blocks into ours
    TARGET = "target"  # the peer's transfer touches our blocks


@dataclass(eq=False, slots=True)
class Transfer:
    """One transfer as this side sees it; `handle` is the backend's own state."""

    id: str
    peer: str
    role: Role
    deadline: float
    lease_s: float
    state: TransferState = TransferState.IN_FLIGHT
    error: str = ""
    lease_until: float = float("inf")
    next_renew: float = 0.0
    handle: Any = None

    def raise_if_failed(self) -> None:
        if self.state.finished and self.state is not TransferState.DONE:
            raise TransferError(f"{self.role.value} {self.id} with {self.peer} "
                                f"({self.state.value}): {self.error}")
