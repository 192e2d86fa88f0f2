"""Acceptance 1 of the engine core: greedy output equals HF `generate` token for token."""
import pytest

from tests.support.hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model, mixed_prompts

NEW_TOKENS = 32


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_bias", "qwen3_qknorm", "llama_tied",
                                    "mistral", "qwen3_moe", "mixtral"])
def test_greedy_matches_hf_with_chunking_prefix_sharing_and_preemption(family, tiny_model_root):
    model_dir = make_tiny_model(family, tiny_model_root)
    prompts = mixed_prompts()
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # Block size 4 and a 7-token budget split every prompt longer than 7 into chunks; 40 blocks
    # (160 tokens) cannot hold 8 sequences of up to 69 tokens, so requests get preempted.
    llm = LLM(model_dir, block_size=4, num_kv_blocks=40, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0, "the pool was meant to be too small"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks

    # Second round: the shared prefixes are now cached, and reusing them changes nothing.
    hits_before = stats.prefix_hits
    again = llm.generate(prompts[:3], params)
    assert [o.outputs[0].token_ids for o in again] == expected[:3]
    assert stats.prefix_hits > hits_before
    assert any(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
