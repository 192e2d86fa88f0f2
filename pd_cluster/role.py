"""Role: what an engine replica does, prefill or decode.

The one home of the engine roles, for every product package (pd_cluster, actors, router):
this module imports nothing of them, so any can import it without a cycle. A colocated
engine, which prefills and decodes, is a DECODE replica. (A KV transfer's side, write / read /
target, is another idea: transfer/state.py.)

A Role is a `str` equal to its value, and its value is how the role is spelt wherever it
leaves the code: replica names (`decode-0`), /health, the `role` label of the metrics, the
custom Ray resource a node group advertises, and config names built on it (`num_prefill`,
`max_decode`, `prefill_tensor_parallel_size`), so `str()`, f-strings and `repr()` show the
value.
"""
from __future__ import annotations

import enum


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @property
    def other(self) -> Role:
        """The role an engine of this one hands its work to, or flips to."""
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL

    @classmethod
    def parse(cls, value: str) -> Role:
        """`value` ("prefill", "decode" or a Role) as a Role; ValueError names the roles."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role: {value!r} is not one of {', '.join(cls)}") from None
