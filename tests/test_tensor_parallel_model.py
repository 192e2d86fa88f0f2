"""Tensor parallelism, model side: two CPU ranks (gloo) compute the logits of one model alone.

The ranks are two spawned processes; each builds its shard of the model (`get_tp()` read at
construction), runs two steps over a paged KV cache of its own KV heads (a prefill of three
sequences, then two decodes and a prompt chunk) and saves its logits. Both ranks' logits must
equal the tp = 1 model's. Everything runs in one pair of processes (their start-up is most of
the cost) and is bounded: a stuck rank is killed, never waited for.
"""
from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from pd_cluster import distributed
from pd_cluster.attention.base import AttentionMetadata
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster.config import ModelConfig
from pd_cluster.distributed import check_tp, get_tp, kv_head_shard
from pd_cluster.forward_context import ForwardContext
from pd_cluster.kv_layout import KVLayout
from pd_cluster.models.loader import load_model
from tiny_models import make_tiny_model

TP = 2
# (family, load_format): GQA with llama3 rope; 1 KV head (replicated); q/k norm; qkv bias;
# tied embeddings; padded vocabulary + tied + 1 KV head; random weights drawn per rank.
CASES = [("llama_gqa", "auto"), ("mistral", "auto"), ("qwen3_qknorm", "auto"),
         ("qwen2_bias", "auto"), ("llama_tied", "auto"), ("llama_odd_vocab", "auto"),
         ("llama_gqa", "dummy")]
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


def _rank_main(rank: int, init_method: str, cases: list[tuple[str, str, str]],
               out_dir: str) -> None:
    rank_cases(rank, init_method, cases, out_dir, two_steps_logits)


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


def _key(family: str, load_format: str) -> str:
    return f"{family}-{load_format}"


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


@pytest.fixture(scope="module")
def rank_outputs(tiny_model_root, tmp_path_factory) -> str:
    """Run every case on 2 ranks; the folder of their outputs."""
    out_dir = str(tmp_path_factory.mktemp("tp_ranks"))
    cases = [(_key(f, fmt), make_tiny_model(f, tiny_model_root), fmt) for f, fmt in CASES]
    run_ranks(_rank_main, cases, out_dir)
    return out_dir


@pytest.mark.parametrize("family,load_format", CASES)
def test_two_ranks_give_the_logits_of_one(family, load_format, rank_outputs, tiny_model_root):
    assert get_tp().size == 1, "this process must be outside any tensor-parallel group"
    expected = two_steps_logits(make_tiny_model(family, tiny_model_root), load_format)
    for rank in range(TP):
        stem = os.path.join(rank_outputs, f"{_key(family, load_format)}.rank{rank}")
        if os.path.exists(stem + ".err"):
            pytest.fail(f"rank {rank} failed:\n" + open(stem + ".err").read())
        if not os.path.exists(stem + ".pt"):
            pytest.fail(f"rank {rank} has no logits: an earlier case failed on some rank")
        got = torch.load(stem + ".pt")
        assert got.shape == expected.shape
        # Only the order of the sums differs (each rank's partial products, then all_reduce).
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_kv_heads_split_or_replicated():
    assert [kv_head_shard(8, 4, r) for r in range(4)] == [(2, 0), (2, 2), (2, 4), (2, 6)]
    # Fewer KV heads than ranks: one each, shared by the ranks of its query heads' group.
    assert [kv_head_shard(2, 4, r) for r in range(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [kv_head_shard(1, 2, r) for r in range(2)] == [(1, 0), (1, 0)]
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\)"):
        kv_head_shard(3, 2, 0)


def _cfg(**shape) -> ModelConfig:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=509, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    return ModelConfig.from_dict({**base, **shape})


def test_check_tp_names_what_does_not_split():
    check_tp(_cfg(), 2)                              # 509 tokens: padded, not refused
    check_tp(_cfg(num_key_value_heads=1), 4)         # one KV head on 4 ranks: replicated
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by the "
                                         r"tensor parallel size \(3\)"):
        check_tp(_cfg(), 3)
    with pytest.raises(ValueError, match=r"intermediate_size \(100\)"):
        check_tp(_cfg(intermediate_size=100, num_attention_heads=8, num_key_value_heads=8), 8)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) is fewer than the tensor "
                                         r"parallel size \(4\)"):
        check_tp(_cfg(num_attention_heads=12, num_key_value_heads=3), 4)


def test_collectives_are_identities_outside_a_group():
    x = torch.arange(6.0).reshape(2, 3)
    assert distributed.all_reduce(x) is x
    assert distributed.all_gather(x) is x
    assert distributed.broadcast_tensor(x) is x
