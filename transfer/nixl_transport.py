"""NIXL transport: one-sided UCX WRITE/READ between registered KV caches (GPU or host memory).

Every KV tensor (shard) is registered once, and the block descriptors of all of them (ours,
and each peer's) are prepared once; a transfer is one NIXL request naming block indices
(merged into runs by NIXL), carrying the DONE notice that NIXL delivers to the peer after the
data. Control messages (RENEW, ABORT) are NIXL notifications too, so both sides must
connect() to each other. A peer that restarted, or whose connection NIXL gave up on, is
connected anew (transfer/peers.py): its remote agent removed and added again, its list
prepared again.

Between KV caches of different head windows (tensor-parallel shardings that differ), blocks
do not move whole: such a transfer is one NIXL request built from explicit (address, length,
device) descriptor lists of its head runs (transfer/runs.py), which costs NIXL a validation
per request that the prepared lists spare the matching-window fast path.
"""
from __future__ import annotations

import importlib
import os
import time

import numpy as np

from pd_cluster.kv_layout import KVLayout
from transfer.base import KVTransport, Role, Transfer
from transfer.messages import KVDescriptor, Message, MsgKind
from transfer.runs import shard_block_indices
from transfer.shards import starts

_NOTHING = "nothing to move"  # handle of a transfer of zero blocks: done once posted
# UCX backend parameters ("num_workers=2,num_threads=4"), for tuning without a code change.
UCX_PARAMS_ENV = "PD_NIXL_UCX_PARAMS"
# The default for KV caches in GPU memory. UCX's cuda_ipc puts a worker's copies to one peer
# device on one CUDA stream (the stream is picked by the peer's device number), so a prompt's
# per-(layer, K|V) runs go one after another; four workers spread them over four streams
# (bench/transfer_bench.py measures the difference).
GPU_UCX_PARAMS = {"num_workers": "4"}
# Where nixl's API lives. The `nixl` meta-package (the `gpu` extra) holds both CUDA builds and
# picks the one matching the machine's CUDA; the `transfer` extra installs the CUDA 12 build
# alone, which moves host memory on a machine without a GPU just as well.
_NIXL_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _nixl_api():
    for name in _NIXL_API_MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name not in (name, name.split(".")[0]):
                raise
    raise ModuleNotFoundError(f"none of {', '.join(_NIXL_API_MODULES)} is installed",
                              name="nixl")


_api = _nixl_api()
nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config


def ucx_params_from_env(on_gpu: bool = False) -> dict[str, str]:
    """PD_NIXL_UCX_PARAMS when set (even empty: UCX's own defaults), else ours for the KV
    cache's memory (`on_gpu`)."""
    if UCX_PARAMS_ENV not in os.environ:
        return dict(GPU_UCX_PARAMS) if on_gpu else {}
    text = os.environ[UCX_PARAMS_ENV].strip()
    pairs = [kv.split("=", 1) for kv in text.split(",") if kv.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{UCX_PARAMS_ENV}={text!r}: expected name=value[,name=value...]")
    return {k.strip(): v.strip() for k, v in pairs}


class NixlTransport(KVTransport):
    backend = "nixl"

    def __init__(self, name: str | None = None, ucx_params: dict[str, str] | None = None,
                 telemetry: bool = False, progress_thread: bool | None = None, **kwargs):
        super().__init__(name, **kwargs)
        self.ucx_params = None if ucx_params is None else dict(ucx_params)  # None: see _register
        self.telemetry = telemetry  # NIXL's per-transfer timings (get_xfer_telemetry), for benches
        self.progress_thread = progress_thread  # None: for GPU memory only (see _register)
        self.agent = None   # made at register(), once we know which memory it moves
        # Requests posted and the descriptor runs in them (neighbouring blocks on both sides
        # merge into one): runs per request is what the posting costs grow with.
        self.posted = self.posted_runs = 0
        self._reg: list = []
        self._local = None
        # Each side's shards for explicit descriptors: (virtual starts, base addresses,
        # device ids) as int64/uint64 arrays, ours under None; and each peer's memory type.
        self._where: dict[str | None, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._peer_mem: dict[str, str] = {}
        self._remote: dict[str, object] = {}  # peer → its prepped descriptor list
        self._stuck: list = []

    def _register(self) -> None:
        kv = self.kv
        # GPU memory: NIXL's progress thread advances transfers while the owner computes (the
        # next layer's prefill). Host memory: that thread spins a core even when idle, which
        # starves the engines on a small CPU machine; the owner's pump progresses the agent
        # often enough (every check and notification poll does).
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=kv.is_cuda if self.progress_thread is None else self.progress_thread,
            backends=[], capture_telemetry=self.telemetry))
        if self.ucx_params is None:
            self.ucx_params = ucx_params_from_env(kv.is_cuda)
        self.agent.create_backend("UCX", self.ucx_params)
        # One registration per shard: a TP engine's shards live on different GPUs.
        self._reg = [self.agent.register_memory(t) for t in self.shards]
        self._mem = "VRAM" if kv.is_cuda else "DRAM"
        shards = [(lay, t.data_ptr(), t.device.index or 0)
                  for t, lay in zip(self.shards, self.shard_layouts)]
        self._local = self._prep("NIXL_INIT_AGENT", shards, self._mem)
        self._where[None] = _where(shards)

    def _prep(self, agent: str, shards: list[tuple[KVLayout, int, int]], mem: str):
        """One descriptor per (layer, part, block) of each shard of a KV cache (layout, base
        address, device), in address order, shard after shard, prepared once.

        Each write then only names indices (make_prepped_xfer) instead of building and
        validating descriptor lists (get_xfer_descs + initialize_xfer), which cost more than
        the posting itself. The list is NIXL's strided form (address, len, device, stride,
        count): one row however large the KV cache, so preparing it is free (an expanded list of
        32 layers x 2 x 100k blocks took 3.5 s and 440 MB). NIXL merges indices that are
        neighbours on both sides back into one run, so contiguous blocks still post as one
        descriptor per (layer, K|V).
        """
        count = shards[0][0].num_layers * shards[0][0].parts * shards[0][0].num_blocks
        if count * len(shards) >= 2**31:  # make_prepped_xfer takes int32 indices
            raise ValueError(f"{count * len(shards)} KV block descriptors: too many for int32 "
                             f"indices")
        try:
            rows = np.array([[base, lay.block_bytes, device, lay.block_bytes, count]
                             for lay, base, device in shards], dtype=np.uint64)
            return self.agent.prep_xfer_dlist(agent, rows, mem)
        except Exception:  # noqa: BLE001 - a NIXL without strided lists: spell them out
            if count * len(shards) > 1 << 22:
                raise
            rows = np.empty((len(shards), count, 3), dtype=np.uint64)
            for i, (lay, base, device) in enumerate(shards):
                bb = np.uint64(lay.block_bytes)
                rows[i, :, 0] = base + np.arange(count, dtype=np.uint64) * bb
                rows[i, :, 1], rows[i, :, 2] = bb, device
            return self.agent.prep_xfer_dlist(agent, rows.reshape(-1, 3), mem)

    def _address(self) -> bytes:
        return self.agent.get_agent_metadata()

    def _connect(self, peer: KVDescriptor) -> None:
        self.agent.add_remote_agent(peer.address)
        shards = [(s.layout, s.base_addr, s.device_id) for s in peer.shards]
        self._peer_mem[peer.agent] = "VRAM" if peer.on_gpu else "DRAM"
        self._remote[peer.agent] = self._prep(peer.agent, shards, self._peer_mem[peer.agent])
        self._where[peer.agent] = _where(shards)

    def _disconnect(self, peer: str) -> None:
        # The peer's prepared list before its agent: the list refers to the agent's metadata.
        dlist = self._remote.pop(peer, None)
        self._where.pop(peer, None)
        self._peer_mem.pop(peer, None)
        if dlist is not None:
            dlist.release()
        self.agent.remove_remote_agent(peer)

    def _plan(self, role: Role, peer: KVDescriptor, layers: range, local_blocks,
              remote_blocks):
        """(local, remote) descriptor indices into the prepared lists when every head window
        matches its source's (whole blocks); else explicit (address, length, device) rows."""
        mine, theirs = self.shard_layouts, peer.layouts
        to_peer, from_peer = self._routes[peer.agent]
        segments = to_peer if role is Role.WRITE else from_peer
        if all(g.whole(mine, theirs) if role is Role.WRITE else g.whole(theirs, mine)
               for g in segments):
            if role is Role.WRITE:
                return shard_block_indices(mine, theirs, segments, layers, local_blocks,
                                           remote_blocks)
            remote, local = shard_block_indices(theirs, mine, segments, layers, remote_blocks,
                                                local_blocks)
            return local, remote
        copies = self._copies(role, peer, layers, local_blocks, remote_blocks)
        return (_rows(self._where[None], copies[:, 0], copies[:, 2]),
                _rows(self._where[peer.agent], copies[:, 1], copies[:, 2]))

    def _post(self, t: Transfer, plan: tuple[np.ndarray, np.ndarray]) -> None:
        local, remote = plan
        notice = Message(MsgKind.DONE, t.id, self.name).encode()
        if not len(local):  # NIXL refuses empty requests; nothing to move, only to tell
            self.agent.send_notif(t.peer, notice)
            t.handle = _NOTHING
            return
        self.posted += 1
        op = "WRITE" if t.role is Role.WRITE else "READ"
        if local.ndim == 2:   # explicit rows: head runs between different windows
            self.posted_runs += len(local)
            t.handle = self.agent.initialize_xfer(
                op, self.agent.get_xfer_descs(local, self._mem),
                self.agent.get_xfer_descs(remote, self._peer_mem[t.peer]), t.peer, notice)
        else:
            self.posted_runs += 1 + int(np.count_nonzero((np.diff(local) != 1)
                                                         | (np.diff(remote) != 1)))
            t.handle = self.agent.make_prepped_xfer(op, self._local, local,
                                                    self._remote[t.peer], remote, notice)
        if self.agent.transfer(t.handle) == "ERR":
            raise ConnectionError("NIXL refused to post the transfer")

    def _check(self, t: Transfer) -> str | None:
        if t.handle is _NOTHING:
            return ""
        try:
            state = self.agent.check_xfer_state(t.handle)
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError: the peer died
            return f"NIXL reported a transfer error: {e!r}"
        if state == "DONE":
            return ""
        if state == "ERR":
            return "NIXL reported a transfer error (the peer died or disconnected?)"
        return None

    def _cancel(self, t: Transfer) -> None:
        self._release(t)

    def _quiet(self, t: Transfer) -> bool:
        # DONE or ERR: NIXL moves nothing more for this request (a drained write, see
        # transfer/drain.py). Still PROC: its WRITE may land yet, whatever our Transfer says.
        if t.handle is None or t.handle is _NOTHING:
            return True
        try:
            return self.agent.check_xfer_state(t.handle) in ("DONE", "ERR")
        except Exception:  # noqa: BLE001 - NIXL failed the request (the peer is gone)
            return True

    def _release(self, t: Transfer) -> None:
        if t.handle is not None and t.handle is not _NOTHING:
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
        if self.agent is None:
            return []
        if self._stuck:
            self._retire_stuck()
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def _close(self) -> None:
        if self.agent is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while not self._retire_stuck() and time.monotonic() < deadline:
            time.sleep(1e-3)
        if self._stuck:
            # Memory a transfer may still touch must stay registered (and allocated).
            return
        for dlist in [*self._remote.values(), self._local]:
            if dlist is not None:
                dlist.release()
        self._remote, self._local = {}, None
        for peer in self.peers:
            self.agent.remove_remote_agent(peer)
        for reg in self._reg:
            self.agent.deregister_memory(reg)
        self._reg = []


def _where(shards: list[tuple[KVLayout, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(virtual starts, base addresses, device ids) of (layout, base, device) shards."""
    return (starts([lay for lay, _, _ in shards]),
            np.array([base for _, base, _ in shards], dtype=np.uint64),
            np.array([dev for _, _, dev in shards], dtype=np.uint64))


def _rows(where: tuple[np.ndarray, np.ndarray, np.ndarray], offsets: np.ndarray,
          lengths: np.ndarray) -> np.ndarray:
    """NIXL's Nx3 (address, length, device) rows of virtual-offset runs (transfer/shards.py)."""
    bounds, bases, devices = where
    shard = np.searchsorted(bounds, offsets, side="right") - 1
    rows = np.empty((len(offsets), 3), dtype=np.uint64)
    rows[:, 0] = bases[shard] + (offsets - bounds[shard]).astype(np.uint64)
    rows[:, 1], rows[:, 2] = lengths, devices[shard]
    return rows
