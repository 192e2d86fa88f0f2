"""NIXL transport: one-sided UCX WRITE/READ between registered pools (GPU or host memory).

The whole KV tensor is registered once; a transfer is one NIXL request over the merged runs,
carrying the DONE notice that NIXL delivers to the peer after the data. Control messages
(RENEW, ABORT) are NIXL notifications too, so both sides must connect() to each other.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from transfer.base import KVTransport, Role, Transfer
from transfer.messages import Message, MsgKind, PoolDescriptor
from transfer.runs import Copy


class NixlTransport(KVTransport):
    backend = "nixl"

    def __init__(self, name: str | None = None, **kwargs):
        super().__init__(name, **kwargs)
        # A progress thread lets transfers advance while the owner computes (e.g. the next
        # layer's prefill), which is what overlaps transfer with compute.
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._reg = None
        self._stuck: list = []

    def _register(self, kv: torch.Tensor) -> None:
        self._reg = self.agent.register_memory(kv)
        self._mem = "VRAM" if kv.is_cuda else "DRAM"

    def _address(self) -> bytes:
        return self.agent.get_agent_metadata()

    def _connect(self, peer: PoolDescriptor) -> None:
        self.agent.add_remote_agent(peer.address)

    def _post(self, t: Transfer, copies: list[Copy]) -> None:
        peer = self.peers[t.peer]
        base, dev = self._registered().data_ptr(), self._registered().device.index or 0
        runs = np.asarray(copies, dtype=np.uint64).reshape(-1, 3)
        local = np.stack([runs[:, 0] + np.uint64(base), runs[:, 2],
                          np.full(len(runs), dev, dtype=np.uint64)], axis=1)
        remote = np.stack([runs[:, 1] + np.uint64(peer.base_addr), runs[:, 2],
                           np.full(len(runs), peer.device_id, dtype=np.uint64)], axis=1)
        remote_mem = "VRAM" if peer.on_gpu else "DRAM"
        op = "WRITE" if t.role is Role.WRITE else "READ"
        notice = Message(MsgKind.DONE, t.id, self.name).encode()
        t.handle = self.agent.initialize_xfer(
            op, self.agent.get_xfer_descs(local, self._mem),
            self.agent.get_xfer_descs(remote, remote_mem), t.peer, notice)
        if self.agent.transfer(t.handle) == "ERR":
            raise ConnectionError("NIXL refused to post the transfer")

    def _check(self, t: Transfer) -> str | None:
        state = self.agent.check_xfer_state(t.handle)
        if state == "DONE":
            return ""
        if state == "ERR":
            return "NIXL reported a transfer error (the peer died or disconnected?)"
        return None

    def _cancel(self, t: Transfer) -> None:
        self._release(t)

    def _release(self, t: Transfer) -> None:
        if t.handle is not None:
            self._stuck.append(t.handle)
            t.handle = None
        self._retire_stuck()

    def _retire_stuck(self) -> bool:
        """Free handles NIXL could not cancel yet (their data is still moving); True if none left.

        Dropping such a handle would let its finalizer free it after the memory is
        deregistered, which crashes the process.
        """
        still = []
        for h in self._stuck:
            try:
                h.release()
            except Exception:  # noqa: BLE001 - still in flight
                still.append(h)
        self._stuck = still
        return not still

    def _send(self, peer: str, msg: Message) -> None:
        self.agent.send_notif(peer, msg.encode())

    def _recv(self) -> list[bytes]:
        if self._stuck:
            self._retire_stuck()
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def _close(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._retire_stuck() and time.monotonic() < deadline:
            time.sleep(1e-3)
        if self._stuck:
            # Memory a transfer may still touch must stay registered (and allocated).
            return
        for peer in self.peers:
            self.agent.remove_remote_agent(peer)
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
