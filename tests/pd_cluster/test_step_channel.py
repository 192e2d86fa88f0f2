"""The tensor-parallel step channel (pd_cluster/step_channel.py): a step's inputs reach a
reader in another process as rank 0 wrote them, in order, across messages longer than a
slot; the stop message ends the reader; a writer whose reader stopped reading gives up at its
timeout instead of waiting for ever."""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from pd_cluster.step_channel import SLOTS, StepChannel, StepInputs


def step_inputs(seed: int, tokens: int, seqs: int, width: int) -> StepInputs:
    rng = np.random.default_rng(seed)
    ints = lambda n: rng.integers(-1, 1 << 40, n, dtype=np.int64)  # noqa: E731
    return StepInputs(ints(tokens), ints(tokens), ints(tokens), ints(seqs), ints(seed % 3),
                      ints(seed % 3), sorted(rng.integers(0, 999, seqs + 1).tolist()),
                      rng.integers(1, 999, seqs).tolist(),
                      rng.integers(0, 1 << 30, (seqs, width), dtype=np.int32),
                      num_decodes=seed % seqs, max_query_len=seed + 1, use_graph=seed % 2 == 0)


def same(a: StepInputs, b: StepInputs) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in StepInputs.__slots__)


# Message sizes: small, one slot exactly-ish, several slots (slot_bytes below is 4 KB).
CASES = [(0, 1, 1, 1), (1, 40, 7, 3), (2, 600, 9, 40), (3, 3000, 64, 100), (4, 5, 2, 1)]
SLOT_BYTES = 4096


def _read_all(path: str, out) -> None:
    channel = StepChannel.attach(path, readers=1, slot_bytes=SLOT_BYTES)
    while (inputs := channel.receive(0)) is not None:
        out.put(inputs)
    out.put("stopped")


@pytest.mark.slow
def test_a_reader_in_another_process_gets_every_step_in_order_then_stops():
    channel = StepChannel.create(readers=1, slot_bytes=SLOT_BYTES)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reader = ctx.Process(target=_read_all, args=(channel.file.path, out), daemon=True)
    reader.start()
    try:
        sent = [step_inputs(*case) for case in CASES * 3]     # 15 messages: the ring wraps
        for inputs in sent:
            channel.send(inputs, timeout_s=60)
        channel.send(None, timeout_s=60)
        got = [out.get(timeout=60) for _ in sent]
        assert out.get(timeout=60) == "stopped"
        assert all(same(a, b) for a, b in zip(sent, got))
        reader.join(30)
        assert reader.exitcode == 0
    finally:
        channel.close()
        if reader.is_alive():
            reader.kill()


def test_a_writer_whose_reader_stopped_reading_times_out():
    channel = StepChannel.create(readers=1, slot_bytes=SLOT_BYTES)
    try:
        small = step_inputs(*CASES[0])
        for _ in range(SLOTS):          # the ring holds this many unread messages
            channel.send(small, timeout_s=1)
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="has not read its step inputs"):
            channel.send(small, timeout_s=0.3)
        assert 0.3 <= time.monotonic() - began < 5
    finally:
        channel.close()
