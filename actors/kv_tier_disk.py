"""The disk tier of the KV cache hierarchy (docs/kv_tiers.md): the blocks a node's host tier
(a DistributedKVCache, actors/kv_pool.py) evicts, one file per block in a directory with a
byte budget, least recently used removed first.

Lifecycle of a block:
    write(key, data)   the host tier evicts it: queued for the writer thread at once (the
                       pool never waits on the disk); a key on disk or queued already is not
                       written again (a block goes down once)
    writer thread      writes `<key>.kvb` (a temporary file renamed into place, so a reader
                       never sees half a file), then removes the least recently used files
                       past `budget_bytes`
    read(key)          the file's bytes if its header and checksum hold (else the file is
                       deleted and None returned: the caller recomputes the block); a block
                       still queued is read from the queue
    a new DiskTier on the same directory (the pool actor restarted) indexes the files there,
    oldest first, so the blocks outlive their pool
File format: MAGIC, key (8 bytes), payload length (8 bytes), a BLAKE2b-128 digest of key and
payload, then the payload (the block's bytes, every layer's K and V).
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from collections import OrderedDict

log = logging.getLogger(__name__)

MAGIC = b"PDKV0001"
_HEADER = len(MAGIC) + 8 + 8 + 16
SUFFIX = ".kvb"
# Most bytes queued for the writer: past this a host eviction's block is dropped instead (the
# disk is slower than the evictions), never waited for.
MAX_QUEUED_BYTES = 256 * 2**20


def _digest(key: int, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(key.to_bytes(8, "little"))
    h.update(payload)
    return h.digest()


def encode(key: int, payload: bytes) -> bytes:
    return (MAGIC + key.to_bytes(8, "little") + len(payload).to_bytes(8, "little")
            + _digest(key, payload) + payload)


def decode(key: int, data: bytes, size: int) -> bytes | None:
    """The payload of a block file of `key`, or None if it is not exactly one intact."""
    if len(data) != _HEADER + size or not data.startswith(MAGIC):
        return None
    at = len(MAGIC)
    if int.from_bytes(data[at:at + 8], "little") != key \
            or int.from_bytes(data[at + 8:at + 16], "little") != size:
        return None
    payload = memoryview(data)[_HEADER:]
    return bytes(payload) if _digest(key, payload) == data[at + 16:_HEADER] else None


class DiskTier:
    """See the module docstring. `block_bytes`: payload size of every block (one layout)."""

    def __init__(self, path: str, budget_bytes: int, block_bytes: int) -> None:
        os.makedirs(path, exist_ok=True)
        self.path, self.budget, self.block_bytes = path, budget_bytes, block_bytes
        self.file_bytes = _HEADER + block_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[int, None] = OrderedDict()   # on disk, oldest first
        self._queued: dict[int, bytes] = {}
        self._queued_bytes = 0
        # Keys to write; an Event: set it once everything before it is written; None: stop.
        self._todo: queue.Queue[int | threading.Event | None] = queue.Queue()
        self.stats = {"disk_bytes_written": 0, "disk_bytes_read": 0, "disk_hits": 0,
                      "disk_evictions": 0, "disk_corrupt": 0, "disk_dropped": 0}
        self._index_existing()
        self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                        name="kv-disk-tier")
        self._thread.start()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._files or key in self._queued

    def __len__(self) -> int:
        with self._lock:
            return len(self._files) + len(self._queued)

    def write(self, key: int, payload: bytes) -> None:
        """Queue a block for the disk (never blocks; see the module docstring)."""
        with self._lock:
            if key in self._files or key in self._queued:
                return
            if self._queued_bytes + len(payload) > MAX_QUEUED_BYTES:
                self.stats["disk_dropped"] += 1
                return
            self._queued[key] = payload
            self._queued_bytes += len(payload)
        self._todo.put(key)

    def read(self, key: int) -> bytes | None:
        """The block's payload, or None (absent, or corrupt: then deleted)."""
        with self._lock:
            payload = self._queued.get(key)
            if payload is None and key not in self._files:
                return None
            if payload is None:
                self._files.move_to_end(key)
        if payload is None:
            try:
                with open(self._file(key), "rb") as f:
                    data = f.read(self.file_bytes + 1)
            except OSError:
                data = b""
            payload = decode(key, data, self.block_bytes)
            if payload is None:
                log.warning("KV disk tier: block %x is corrupt or truncated; dropped (it "
                            "is recomputed)", key)
                with self._lock:
                    self.stats["disk_corrupt"] += 1
                    self._files.pop(key, None)
                self._unlink(key)
                return None
        with self._lock:
            self.stats["disk_hits"] += 1
            self.stats["disk_bytes_read"] += len(payload)
        return payload

    def used_bytes(self) -> int:
        with self._lock:
            return len(self._files) * self.file_bytes

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block is on disk (tests, shutdown); False on timeout."""
        done = threading.Event()
        self._todo.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (within `timeout_s`), then stop the writer."""
        self.flush(timeout_s)
        self._todo.put(None)
        self._thread.join(timeout_s)

    # -- internals -----------------------------------------------------------------------
    def _file(self, key: int) -> str:
        return os.path.join(self.path, f"{key:016x}{SUFFIX}")

    def _unlink(self, key: int) -> None:
        self._unlink_name(os.path.basename(self._file(key)))

    def _unlink_name(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.path, name))
        except OSError:   # gone already (another tier process of the host removed it)
            pass

    def _index_existing(self) -> None:
        found = []
        for name in os.listdir(self.path):
            if name.endswith(SUFFIX + ".tmp"):   # a write its writer did not finish
                self._unlink_name(name)
            elif name.endswith(SUFFIX):
                try:
                    key = int(name[:-len(SUFFIX)], 16)
                    found.append((os.path.getmtime(os.path.join(self.path, name)), key))
                except (ValueError, OSError):
                    continue
        for _, key in sorted(found):
            self._files[key] = None
        self._trim()

    def _write_loop(self) -> None:
        while True:
            key = self._todo.get()
            if key is None:
                return
            if isinstance(key, threading.Event):
                key.set()
                continue
            with self._lock:
                payload = self._queued.get(key)
            if payload is None:
                continue
            tmp = self._file(key) + ".tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(encode(key, payload))
                os.replace(tmp, self._file(key))
                ok = True
            except OSError as e:   # a full or failing disk costs the block, not the pool
                log.warning("KV disk tier: writing block %x failed: %s", key, e)
                ok = False
            with self._lock:
                self._queued_bytes -= len(self._queued.pop(key, b""))
                if ok:
                    self._files[key] = None
                    self.stats["disk_bytes_written"] += len(payload)
            self._trim()

    def _trim(self) -> None:
        """Remove the least recently used files past the budget."""
        while True:
            with self._lock:
                if len(self._files) * self.file_bytes <= self.budget or not self._files:
                    return
                key, _ = self._files.popitem(last=False)
                self.stats["disk_evictions"] += 1
            self._unlink(key)
