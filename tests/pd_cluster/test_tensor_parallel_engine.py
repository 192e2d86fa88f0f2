"""Tensor parallelism in the engine, on the CPU (gloo, 2 ranks: rank 0 in this process, rank 1
a child process): greedy output equals HF token for token with chunked prefill, prefix
caching and preemption, for a GQA Llama, Qwen3 (q/k norm), a model with one KV head (held
by both ranks) and mixtures of experts (each rank a slice of every expert, or with expert
parallelism half the experts); a rank that dies fails the engine's next step instead of
hanging it."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model, mixed_prompts

# 12 tokens with 30 blocks still preempt (the pool holds 120 tokens of the 250 asked for).
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.slow
# Each family once: Qwen3-MoE with every expert sliced across the ranks, Mixtral with expert
# parallelism (the two MoE layouts; each family's model code is the same in both).
@pytest.mark.parametrize("family, expert_parallel", [
    ("llama_gqa", False), ("qwen3_qknorm", False), ("mistral", False), ("qwen3_moe", False),
    ("mixtral", True)])
def test_tp2_greedy_matches_hf_with_chunking_prefix_sharing_and_preemption(family,
                                                                           expert_parallel,
                                                                           tiny_model_root):
    model_dir = make_tiny_model(family, tiny_model_root)
    prompts = mixed_prompts()
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # As tests/pd_cluster/test_engine_matches_hf.py: chunks of 7 tokens, too few blocks for all 8.
    with LLM(model_dir, block_size=4, num_kv_blocks=30, max_num_batched_tokens=7,
             tensor_parallel_size=2, enable_expert_parallel=expert_parallel) as llm:
        assert llm.engine.runner.num_kv_heads == max(1, llm.engine.model_cfg.num_kv_heads // 2)
        if expert_parallel:
            assert llm.engine.runner.model.layers[0].mlp.experts.num_local == 2    # of 4
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0, "the pool was meant to be too small"
        hits = stats.prefix_hits
        again = llm.generate(prompts[:3], GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected[:3]
        assert stats.prefix_hits > hits
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.slow
def test_a_dead_rank_fails_the_next_step_instead_of_hanging(tiny_model_root):
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    llm = LLM(model_dir, block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        worker = llm.engine.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        began = time.monotonic()
        with pytest.raises(RuntimeError):    # the broken collective (gloo: peer closed)
            llm.generate([[1, 2, 3, 4, 5]], GREEDY)
        assert time.monotonic() - began < 60
        assert llm.engine.runner.workers.dead() == [1]
    finally:
        llm.close()


def _first_worker_pid(actor) -> int:
    return actor.loop.engine.runner.workers.procs[0].pid


def test_a_dead_rank_ends_its_engine_actor_so_the_replica_is_replaced(ray_cluster,
                                                                     tiny_model_root):
    """In an engine actor a failed step with a dead rank ends the actor's process: callers get
    RayActorError (requests migrate, the controller restarts the replica), not a hang."""
    import ray
    from ray.exceptions import RayActorError

    from actors.colocated_actor import ColocatedActor
    from pd_cluster.config import EngineConfig

    config = EngineConfig(model=make_tiny_model("llama_gqa", tiny_model_root), block_size=4,
                          num_kv_blocks=64, tensor_parallel_size=2)
    actor = ColocatedActor.options(num_cpus=0).remote(config, 0, 60.0)
    ray.get(actor.load.remote(), timeout=120)
    os.kill(ray.get(actor.__ray_call__.remote(_first_worker_pid), timeout=30), signal.SIGKILL)
    with pytest.raises(RayActorError):
        ray.get(actor.run_offline.remote([[1, 2, 3, 4, 5]], GREEDY, 1), timeout=90)


def test_more_ranks_than_visible_gpus_are_refused_before_any_rank_starts(tiny_model_root):
    import torch

    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    ranks = max(2, torch.cuda.device_count() + 1)     # more than this machine has
    with pytest.raises(ValueError, match=f"tensor_parallel_size={ranks} needs {ranks} GPUs"):
        LLM(model_dir, device="cuda", tensor_parallel_size=ranks)
