"""The peer-memory all-reduce (pd_cluster/peer_all_reduce.py, kernels/peer_all_reduce.py) on
CPU ranks: real processes, a real gloo group, shared memory that each maps, and the Triton
kernels under the interpreter, so the protocol itself (epochs on the device, the one-shot's
parity halves, the two-shot's owners) is what runs.

- A run of all-reduces of changing sizes and dtypes, in place, equals the sum added in fp32 in
  rank order on every rank: two ranks (one-shot), three ranks (two-shot above 256 KB); 16-bit
  messages go by push (kernels/peer_push_all_reduce.py), interleaved with the others, and
  inputs full of -0.0 (the push's empty mark) are summed, not waited for; the all-reduce
  fused with the residual add and RMSNorm gives the residual exactly and the norm as its
  torch reference does, by push and by barrier, interleaved with the plain ones; every push
  program counts every push call (the parity is the call's, whatever the sizes).
- A rank whose peer never arrives stops waiting after its spin budget and reports the peer
  lost, instead of hanging: by barrier (fp32) and by push (fp16).
- GPU (2 or more, NVLink): the same run in bf16 over CUDA IPC, bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from pd_cluster.tp_workers import free_tcp_port

pytestmark = pytest.mark.slow       # ranks are processes that import torch and Triton

# (elements, dtype): one chunk; chunks across programs; several chunks per program (over 64
# chunks of 4096), which is two-shot at three ranks; a single element.
CALLS = [(5, torch.float32), (4096 * 3 + 7, torch.float16), (4096 * 70 + 1, torch.float32),
         (300, torch.float32), (4096 * 70 + 1, torch.float16), (1, torch.float16),
         (4096 + 3, torch.float16)]
# Three ranks: what a third rank changes (two-shot for the large fp32 message, one-shot and
# push with two peers, the -0.0 inputs); the large fp16 push and the mid-size fp32 message
# take the same paths at two ranks as at three, and run there.
THREE_RANK_CALLS = [CALLS[0], CALLS[1], CALLS[2], CALLS[5], CALLS[6]]
# The all-reduce fused with the residual add and RMSNorm: [rows, HIDDEN], rows past the 64
# programs (two rows for some).
HIDDEN = 64
NORM_CALLS = [(3, torch.float32), (70, torch.float32), (1, torch.float16), (5, torch.float16)]


# A lost peer's rank polls this often in each of its programs before it gives up: the peer
# never comes, so any budget shows the give-up, and each poll is slow under the interpreter.
LOST_PEER_SPINS = 200


def _rank(rank: int, world: int, port: int, calls: list, out, lose_peer: bool,
          device_type: str) -> None:
    """One rank: the run of `calls` (if any), then with `lose_peer` a call of each protocol
    that rank 1 never joins; puts (rank, what came out wrong, peer lost after the run, peer
    lost after each lone call)."""
    if device_type == "cpu":
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        from kernels.testing import use_interpreter_without_gpu
        use_interpreter_without_gpu()
    device = torch.device(device_type, rank if device_type == "cuda" else None)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    import torch.distributed as dist

    from pd_cluster.peer_all_reduce import PeerAllReduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    peer = PeerAllReduce(rank, world, device, dist.group.WORLD, max_bytes=2 << 20)
    wrong = _sum_calls(peer, rank, world, device, calls) if calls else []
    lost_after_run = peer.peer_lost()
    lost = _lose_peer(peer, rank, device) if lose_peer else []
    out.put((rank, wrong, lost_after_run, lost))
    dist.barrier()
    peer.close()
    dist.destroy_process_group()


def _sum_calls(peer, rank: int, world: int, device: torch.device, calls: list) -> list:
    """The calls that came out wrong: plain ones, then fused with add and RMSNorm."""
    from kernels.peer_all_reduce import add_rms_norm_ref, all_reduce_ref

    wrong = []
    for i, (n, dtype) in enumerate(calls * 2):      # twice: both parity halves reused
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(i * 7 + r))
              .to(device=device, dtype=dtype) for r in range(world)]
        if i == len(calls) - 1:
            for x in xs:
                x[::2] = -0.0       # the push's empty mark, sent as +0.0
        got = xs[rank].clone()
        peer(got)
        if not torch.equal(got, all_reduce_ref(xs)):
            wrong.append((n, str(dtype)))
    for i, (rows, dtype) in enumerate(NORM_CALLS * 2):
        g = torch.Generator().manual_seed(1000 + i)
        xs = [torch.randn(rows, HIDDEN, generator=g).to(device=device, dtype=dtype)
              for _ in range(world)]
        residual = torch.randn(rows, HIDDEN, generator=g).to(device=device, dtype=dtype)
        weight = torch.rand(HIDDEN, generator=g).to(device=device, dtype=dtype)
        out_ref, res_ref = add_rms_norm_ref(xs, residual, weight, 1e-5)
        got, res = peer.add_rms_norm(xs[rank].clone(), residual, weight, 1e-5, False)
        if not (torch.equal(res, res_ref) and torch.allclose(got.float(), out_ref.float(),
                                                             rtol=2e-3, atol=1e-5)):
            wrong.append(("norm", rows, str(dtype)))
    if len(set(peer.push_counters.tolist())) != 1:
        wrong.append("push programs disagree on the call's parity")
    return wrong


def _lose_peer(peer, rank: int, device: torch.device) -> list[bool]:
    """Rank 0 alone calls by barrier (fp32), then by push (fp16): whether each rank saw its
    peer lost after each."""
    peer.max_spins = LOST_PEER_SPINS
    lost = []
    for dtype in (torch.float32, torch.float16):
        if rank == 0:
            peer(torch.ones(10, device=device, dtype=dtype))
        lost.append(peer.peer_lost())
        peer.failed.zero_()
    return lost


def _get(out, procs: list, timeout_s: float = 240):
    """The next rank's result; fails at once when a rank died without one."""
    import queue
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a rank exited with {failed}"
    raise TimeoutError("no result from the ranks")


def run_ranks(world: int, lose_peer: bool = False, device_type: str = "cpu",
              calls: list = CALLS) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_tcp_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, calls, out, lose_peer,
                                             device_type), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(_get(out, procs) for _ in procs)
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * world
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def two_ranks() -> list:
    """One pair of CPU ranks for both two-rank tests (each rank a process that imports torch
    and Triton): the run of CALLS, then rank 0 calling alone, last since it leaves the ranks'
    epochs apart."""
    return run_ranks(2, lose_peer=True)


def test_two_ranks_sum_every_size_exactly_one_shot(two_ranks):
    assert [r[:3] for r in two_ranks] == [(0, [], False), (1, [], False)]


def test_three_ranks_sum_every_size_exactly_two_shot_for_large_messages():
    assert run_ranks(3, calls=THREE_RANK_CALLS) == [(r, [], False, []) for r in range(3)]


def test_a_rank_whose_peer_never_arrives_gives_up_and_says_so(two_ranks):
    assert [(r[0], r[3]) for r in two_ranks] == [(0, [True, True]), (1, [False, False])]


@pytest.mark.gpu
def test_gpus_sum_every_size_exactly_in_bf16():
    world = min(4, torch.cuda.device_count())
    if world < 2:
        pytest.skip("needs two GPUs")
    calls = CALLS + [(n, torch.bfloat16) for n, _ in CALLS] + [(1 << 20, torch.bfloat16)]
    assert run_ranks(world, device_type="cuda", calls=calls) == \
        [(r, [], False, []) for r in range(world)]
