"""Typed messages between the router and the disaggregated actors."""
from __future__ import annotations

from dataclasses import dataclass

from pd_cluster.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class KVDestination:
    """Where a prefill engine writes a request's prompt KV: a decode engine's reserved blocks."""

    pool: bytes                  # the decode engine's encoded PoolDescriptor
    agent: str                   # its transport agent name
    block_ids: list[int]         # blocks for the whole prompt, in order
    num_cached_tokens: int       # prompt tokens the decode engine already holds (not re-sent)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the prefill engine hands over once every KV write has landed."""

    token: int                            # the first generated token
    logprobs: dict[int, float] | None
    pool: bytes                           # the prefill engine's encoded PoolDescriptor
    agent: str
    transfer_ids: list[str]               # the writes the decode engine must see completed
    num_cached_tokens: int                # prompt tokens the prefill engine found cached
    kv_bytes: int                         # bytes it wrote
    transfer_s: float                     # from its first write to the last completion
    first_output: RequestOutput           # the prefill engine's output for the first token
