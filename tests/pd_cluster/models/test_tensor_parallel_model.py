"""Tensor parallelism, model side: two CPU ranks (gloo) compute the logits of one model alone.

The ranks are two spawned processes; each builds its shard of the model (`get_tp()` read at
construction), runs two steps over a paged KV cache of its own KV heads (a prefill of three
sequences, then two decodes and a prompt chunk) and saves its logits. Both ranks' logits must
equal the tp = 1 model's. Everything runs in one pair of processes (their start-up is most of
the cost) and is bounded: a stuck rank is killed, never waited for.
"""
from __future__ import annotations

import os

import pytest
import torch

from pd_cluster import distributed
from pd_cluster.config import ModelConfig
from pd_cluster.distributed import check_tp, get_tp, kv_head_shard
from tests.support.tiny_models import make_tiny_model
from tests.support.tp_ranks import TP, rank_cases, run_ranks, two_steps_logits

# (family, load_format): GQA with llama3 rope; 1 KV head (replicated); q/k norm; qkv bias;
# tied embeddings; padded vocabulary + tied + 1 KV head; random weights drawn per rank.
CASES = [("llama_gqa", "auto"), ("mistral", "auto"), ("qwen3_qknorm", "auto"),
         ("qwen2_bias", "auto"), ("llama_tied", "auto"), ("llama_odd_vocab", "auto"),
         ("llama_gqa", "dummy")]


def _rank_main(rank: int, init_method: str, cases: list[tuple[str, str, str]],
               out_dir: str) -> None:
    rank_cases(rank, init_method, cases, out_dir, two_steps_logits)


def _key(family: str, load_format: str) -> str:
    return f"{family}-{load_format}"


@pytest.fixture(scope="module")
def rank_outputs(tiny_model_root, tmp_path_factory) -> str:
    """Run every case on 2 ranks; the folder of their outputs."""
    out_dir = str(tmp_path_factory.mktemp("tp_ranks"))
    cases = [(_key(f, fmt), make_tiny_model(f, tiny_model_root), fmt) for f, fmt in CASES]
    run_ranks(_rank_main, cases, out_dir)
    return out_dir


@pytest.mark.slow
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
