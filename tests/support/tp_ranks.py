"""Two CPU ranks (gloo) in spawned processes, and the two steps of logits that the tensor-parallel
model tests compare across ranks."""
from __future__ import annotations

import os
import time
import traceback

import torch
import torch.multiprocessing as mp

from pd_cluster import distributed
from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster.config import ModelConfig
from pd_cluster.distributed import get_tp, kv_head_shard
from pd_cluster.forward_context import ForwardContext
from pd_cluster.kv_layout import KVLayout
from pd_cluster.models.loader import load_model

TP = 2
BLOCK, BLOCKS_PER_SEQ = 4, 4
RANK_TIMEOUT_S = 240      # both ranks, all cases (about 20 s on 2 CPU cores)
COLLECTIVE_TIMEOUT_S = 60


def _meta(seqs: list[tuple[int, int, int]]) -> AttentionMetadata:
    """seqs: (sequence index, tokens already cached, new tokens), decodes first."""
    q_start, seq_lens, slots = [0], [], []
    for i, cached, new in seqs:
        q_start.append(q_start[-1] + new)
        seq_lens.append(cached + new)
        slots += [(i * BLOCKS_PER_SEQ + p // BLOCK) * BLOCK + p % BLOCK
                  for p in range(cached, cached + new)]
    tables = [[i * BLOCKS_PER_SEQ + b for b in range(BLOCKS_PER_SEQ)] for i, _, _ in seqs]
    decodes = sum(1 for _, _, new in seqs if new == 1)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=i32(q_start), seq_lens=i32(seq_lens),
        block_tables=i32(tables), num_decodes=decodes, num_decode_tokens=decodes,
        max_query_len=max(n for _, _, n in seqs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=q_start, seq_lens_cpu=seq_lens)


def two_steps_logits(model_dir: str, load_format: str) -> torch.Tensor:
    """Logits [T, vocab] of every token of two steps, on a model built for this process's
    tensor-parallel group, with a KV cache of its own KV heads."""
    cfg = ModelConfig.from_dir(model_dir)
    tp = get_tp()
    model = load_model(model_dir, cfg, 64, torch.float32, torch.device("cpu"), load_format, 0)
    local_kv_heads = kv_head_shard(cfg.num_kv_heads, tp.size, tp.rank)[0]
    assert model.layers[0].self_attn.num_kv_heads == local_kv_heads
    layout = KVLayout(model="tiny", dtype="float32", num_layers=cfg.num_layers,
                      num_blocks=3 * BLOCKS_PER_SEQ, block_size=BLOCK,
                      num_kv_heads=local_kv_heads, head_dim=cfg.head_dim)
    ctx_of = lambda meta: ForwardContext(meta, kv_cache, TorchAttentionBackend())  # noqa: E731
    kv_cache = layout.allocate()
    gen = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen)  # noqa: E731
    # The last ids of the vocabulary sit on the last rank, next to any padding rows.
    first = torch.cat([ids(4), torch.tensor([cfg.vocab_size - 1]), ids(10)])
    second = torch.cat([ids(2), torch.tensor([cfg.vocab_size - 2]), ids(3)])
    steps = [  # prefills of 5, 7, 3 tokens; then decodes of sequences 0 and 2, 4 more of 1
        (first, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]),
         _meta([(0, 0, 5), (1, 0, 7), (2, 0, 3)])),
        (second, torch.tensor([5, 3, 7, 8, 9, 10]), _meta([(0, 5, 1), (2, 3, 1), (1, 7, 4)])),
    ]
    out = []
    with torch.inference_mode():
        for input_ids, positions, meta in steps:
            hidden = model(input_ids, positions, ctx_of(meta))
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def rank_cases(rank: int, init_method: str, cases: list[tuple[str, str, str]], out_dir: str,
               compute) -> None:
    """One rank: every case's `compute(model_dir, load_format)` to out_dir/{case}.rank{rank}.pt,
    or its traceback to .err and no further case (the ranks' collectives would no longer pair
    up; one left waiting in a collective gives up after COLLECTIVE_TIMEOUT_S)."""
    torch.set_num_threads(1)      # two ranks on two cores
    distributed.init_tp(rank, TP, init_method, "gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        for key, model_dir, load_format in cases:
            stem = os.path.join(out_dir, f"{key}.rank{rank}")
            try:
                torch.save(compute(model_dir, load_format), stem + ".pt")
            except Exception:
                with open(stem + ".err", "w") as f:
                    f.write(traceback.format_exc())
                break
    finally:
        distributed.destroy_tp()


def run_ranks(target, cases: list, out_dir: str, tp: int = TP,
              timeout_s: float = RANK_TIMEOUT_S) -> None:
    """`target(rank, init_method, cases, out_dir)` in `tp` spawned processes that meet at a
    file rendezvous in `out_dir`; asserts all of them exit 0 within `timeout_s` (a stuck one
    is killed)."""
    init_method = "file://" + os.path.join(out_dir, "rendezvous")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, init_method, cases, out_dir), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stuck:
        procs[r].kill()
        procs[r].join(10)
    assert not stuck, f"ranks {stuck} still running after {timeout_s} s: killed"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * tp, f"rank exit codes {codes}"
