"""Typed wire messages of the KV transport, encoded with msgpack (never pickle).

Everything that crosses between engines is one of two types:
- `KVDescriptor`: what a peer needs to reach a registered KV cache, every shard of it
  (exported once, sent out of band, e.g. as the return value of an actor method);
- `Message`: a small control message (completion notice, lease renewal, abort, ...).
Decoding validates field types, so bytes from a peer can at worst raise `MessageError`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

import msgpack

from pd_cluster.kv_layout import KVLayout


class MessageError(ValueError):
    """Bytes from a peer that are not a well-formed message."""


class MsgKind(Enum):
    DONE = "done"          # the sender's transfer touching the receiver's blocks completed
    RENEW = "renew"        # the sender is alive and still using the receiver's blocks
    ABORT = "abort"        # the sender gave up on the transfer; free the blocks it touched
    # The sender's transfers of one group (`transfer_id` names the group, e.g. a request:
    # transfer/drain.py) have all completed or failed, and it starts no more: blocks the
    # receiver fenced off for them may go to a new owner.
    DRAINED = "drained"
    # Backend-internal kinds, for transports without one-sided memory access (ray, ucx):
    DATA = "data"          # a payload follows / is attached; `runs` says where it lands
    ACK = "ack"            # the receiver of DATA has copied it in
    READ_REQ = "read_req"  # send me these runs of your KV cache (`runs`), tagged `tag`


Run = tuple[int, int]  # (byte offset into a KV cache, byte length)


@dataclass(frozen=True, slots=True)
class Message:
    kind: MsgKind
    transfer_id: str
    sender: str
    detail: str = ""
    runs: tuple[Run, ...] = ()
    tag: int = 0

    def encode(self) -> bytes:
        return msgpack.packb([self.kind.value, self.transfer_id, self.sender, self.detail,
                              [list(r) for r in self.runs], self.tag])

    @classmethod
    def decode(cls, data: bytes) -> "Message":
        try:
            kind, tid, sender, detail, runs, tag = msgpack.unpackb(data, use_list=True)
            msg = cls(MsgKind(kind), tid, sender, detail,
                      tuple((int(o), int(n)) for o, n in runs), tag)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise MessageError(f"malformed transport message: {e}") from e
        _check_types(msg, transfer_id=str, sender=str, detail=str, tag=int)
        return msg


@dataclass(frozen=True, slots=True)
class KVShard:
    """One registered tensor of a KV cache: its layout (head window) and where it lives."""

    layout: KVLayout
    base_addr: int
    device_id: int              # CUDA device ordinal; 0 for host memory


@dataclass(frozen=True, slots=True)
class KVDescriptor:
    """How to reach a registered KV cache: backend, unique agent name, and its shards (one per
    tensor-parallel rank, in rank order; one for an unsharded cache)."""

    backend: str
    agent: str
    shards: tuple[KVShard, ...]
    on_gpu: bool
    address: bytes = field(default=b"", repr=False)  # backend connection info

    @property
    def layout(self) -> KVLayout:
        """The whole KV cache's layout: every KV head, as one unsharded tensor would hold."""
        return self.shards[0].layout.whole()

    @property
    def layouts(self) -> tuple[KVLayout, ...]:
        return tuple(s.layout for s in self.shards)

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> "KVDescriptor":
        try:
            d = msgpack.unpackb(data)
            if "shards" not in d:   # from before sharding: one tensor, its fields inline
                d["shards"] = [{k: d.pop(k) for k in ("layout", "base_addr", "device_id")}]
            shards = tuple(KVShard(**{**s, "layout": KVLayout(**s["layout"])})
                           for s in d.pop("shards"))
            desc = cls(**d, shards=shards)
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as e:
            raise MessageError(f"malformed KV descriptor: {e}") from e
        _check_types(desc, backend=str, agent=str, on_gpu=bool, address=bytes)
        for s in shards:
            _check_types(s, base_addr=int, device_id=int)
        if not shards:
            raise MessageError("malformed KV descriptor: no shards")
        return desc


def _check_types(obj: object, **types: type) -> None:
    for name, typ in types.items():
        if not isinstance(getattr(obj, name), typ):
            raise MessageError(f"{type(obj).__name__}.{name} must be {typ.__name__}")
