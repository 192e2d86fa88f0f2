"""Rank 0's step inputs to the other ranks of a tensor-parallel engine, through shared memory.

Rank 0 writes each step's `StepInputs` into a ring in a shared file; ranks 1..N-1 read every
message in order. Nothing is pickled and no socket is crossed: a message is the step's
arrays packed as they are (pd_cluster/upload.py `pack`) behind a header of their lengths, and
a write is a memcpy. Rank 0 never waits for the readers unless the ring is full (they are
SLOTS messages behind), so with async scheduling it plans step k+1 while every rank runs step
k, and the readers pick it up as soon as it is written.

Layout of the file (int64 words; each counter on a cache line of its own):

    written            messages rank 0 has written (message k lives in slot k % SLOTS)
    read[r]            messages reader r has finished with
    slots[SLOTS]       slot_bytes each; a message longer than a slot takes several in a row

A message: a header [HEADER] of int64 (its length in bytes, then StepInputs' lengths and
scalars; a length of -1 means "stop"), then the packed arrays.

The counters are written after the bytes they guard and read before them; a lock's acquire
and release (a full barrier on every CPU) fences each side, which x86's store order would
give for free but Arm's does not.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from pd_cluster.peer_memory import SharedFile
from pd_cluster.upload import pack

SLOTS = 8
SLOT_BYTES = 256 << 10      # a decode step takes a few KB; a long prefill takes several slots
LINE = 8                    # int64 words of a cache line
HEADER = 10                 # int64 words: see _encode
# A reader on a GPU spins (yielding the CPU) this long after each message before it naps:
# in a steady stream the next step comes within that, and a nap would delay its launch. Naps
# then double from FIRST_NAP_S to MAX_NAP_S, so an idle engine's ranks cost next to nothing.
GPU_SPIN_S = 0.05
FIRST_NAP_S = 0.0001
MAX_NAP_S = 0.002

_fence_lock = threading.Lock()


@dataclass(slots=True)
class StepInputs:
    """One step's inputs on the host, as every tensor-parallel rank needs them."""

    ids: np.ndarray            # [T] int64 input tokens (PENDING_TOKEN: filled on the device)
    pos: np.ndarray            # [T] int64 positions
    slots: np.ndarray          # [T] int64 KV slot of each token
    sample_idx: np.ndarray     # [S] int64 rows of the hidden states that sample
    fill_at: np.ndarray        # [F] int64 input rows whose token the last step sampled...
    fill_from: np.ndarray      # [F] int64 ...from this row of its samples
    q_start: list[int]         # [B + 1] query start of each sequence
    seq_lens: list[int]        # [B] tokens in context after this step
    tables: np.ndarray         # [B, max blocks] int32 block tables
    num_decodes: int           # leading sequences with one query token
    max_query_len: int
    # Replay a CUDA graph (decided by rank 0: every rank must issue the same collectives).
    use_graph: bool = False


def _fence() -> None:
    with _fence_lock:
        pass


class StepChannel:
    """One writer (rank 0, `create`), `readers` readers (`attach` by path, reader index r)."""

    def __init__(self, file: SharedFile, readers: int, slot_bytes: int, spin_s: float = 0.0):
        self.file, self.readers, self.slot_bytes = file, readers, slot_bytes
        self.spin_s = spin_s    # a reader's (GPU_SPIN_S on a GPU: a CPU rank would steal
                                # the cores its own steps need)
        words = file.view.numpy().view(np.int64)
        self._written = words[0:1]
        self._read = words[LINE:LINE * (1 + readers):LINE]
        self._slots = file.view.numpy()[LINE * 8 * (1 + readers):]
        self._next = 0          # the next message's sequence number (writer or this reader)

    @classmethod
    def create(cls, readers: int, slot_bytes: int = SLOT_BYTES) -> StepChannel:
        size = LINE * 8 * (1 + readers) + SLOTS * slot_bytes
        return cls(SharedFile.create(size, "pd-steps-"), readers, slot_bytes)

    @classmethod
    def attach(cls, path: str, readers: int, slot_bytes: int = SLOT_BYTES,
               spin_s: float = 0.0) -> StepChannel:
        return cls(SharedFile(path), readers, slot_bytes, spin_s)

    # -- writer -------------------------------------------------------------------------

    def send(self, inputs: StepInputs | None, timeout_s: float) -> None:
        """Write one step's inputs (None: tell the readers to stop). Raises TimeoutError if
        a reader falls SLOTS messages behind for timeout_s (it died or is stuck)."""
        message = _encode(inputs)
        for at in range(0, len(message), self.slot_bytes):
            self._wait_for_room(timeout_s)
            part = message[at:at + self.slot_bytes]
            self._slot(self._next)[:len(part)] = part
            _fence()
            self._next += 1
            self._written[0] = self._next

    def _wait_for_room(self, timeout_s: float) -> None:
        deadline = None
        while self._next - int(self._read.min()) >= SLOTS:
            deadline = deadline or time.monotonic() + timeout_s
            if time.monotonic() > deadline:
                raise TimeoutError(f"a tensor-parallel rank has not read its step inputs for "
                                   f"{timeout_s:.0f} s (dead or stuck)")
            time.sleep(FIRST_NAP_S)
        _fence()

    # -- reader -------------------------------------------------------------------------

    def receive(self, reader: int) -> StepInputs | None:
        """The next step's inputs (waits as long as it takes), or None: stop."""
        first = self._take()
        length = int(first[:8].view(np.int64)[0])
        if length < 0:
            self._done(reader)
            return None
        message = np.empty(length, dtype=np.uint8)
        at = 0
        while True:
            n = min(length - at, self.slot_bytes)
            message[at:at + n] = first[:n]
            self._done(reader)
            at += n
            if at == length:
                return _decode(message)
            first = self._take()

    def _take(self) -> np.ndarray:
        spin_until, nap = time.monotonic() + self.spin_s, FIRST_NAP_S
        while int(self._written[0]) <= self._next:
            if time.monotonic() < spin_until:
                time.sleep(0)
                continue
            time.sleep(nap)
            nap = min(2 * nap, MAX_NAP_S)
        _fence()
        return self._slot(self._next)

    def _done(self, reader: int) -> None:
        _fence()
        self._next += 1
        self._read[reader] = self._next

    def _slot(self, seq: int) -> np.ndarray:
        at = (seq % SLOTS) * self.slot_bytes
        return self._slots[at:at + self.slot_bytes]

    def unlink(self) -> None:
        self.file.unlink()

    def close(self) -> None:
        self.file.unlink()
        self.file.close()


def _encode(x: StepInputs | None) -> np.ndarray:
    """Header + packed arrays of a StepInputs (or the stop message for None)."""
    if x is None:
        return np.array([-1], dtype=np.int64).view(np.uint8)
    tables = np.ascontiguousarray(x.tables, dtype=np.int32)
    arrays = [x.ids, x.pos, x.slots, x.sample_idx, x.fill_at, x.fill_from,
              np.asarray(x.q_start, dtype=np.int64), np.asarray(x.seq_lens, dtype=np.int64),
              tables]
    packed, _ = pack(arrays)
    header = np.array([HEADER * 8 + packed.numel(), len(x.ids), len(x.sample_idx),
                       len(x.fill_at), len(x.seq_lens), tables.shape[1], x.num_decodes,
                       x.max_query_len, int(x.use_graph), 0], dtype=np.int64)
    return np.concatenate([header.view(np.uint8), packed.numpy()])


def _decode(message: np.ndarray) -> StepInputs:
    _, t, s, f, b, width, num_decodes, max_query_len, use_graph, _ = \
        message[:HEADER * 8].view(np.int64).tolist()
    body, at = message[HEADER * 8:], 0
    out = []
    for count, dtype, shape in [(t, np.int64, None), (t, np.int64, None), (t, np.int64, None),
                                (s, np.int64, None), (f, np.int64, None), (f, np.int64, None),
                                (b + 1, np.int64, None), (b, np.int64, None),
                                (b * width, np.int32, (b, width))]:
        nbytes = count * np.dtype(dtype).itemsize
        a = body[at:at + nbytes].view(dtype)
        out.append(a.reshape(shape) if shape else a)
        at += -(-nbytes // 8) * 8
    ids, pos, slots, sample_idx, fill_at, fill_from, q_start, seq_lens, tables = out
    return StepInputs(ids, pos, slots, sample_idx, fill_at, fill_from, q_start.tolist(),
                      seq_lens.tolist(), tables, num_decodes, max_query_len, bool(use_graph))
