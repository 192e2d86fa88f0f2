"""Loading: sharded safetensors, dummy weights, dtypes, and clear errors."""
import json
import os

import pytest
import torch

from tests.support.hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [4, 8, 15, 16, 23, 42]


def test_sharded_checkpoint_loads_and_matches_hf(tiny_model_root, tmp_path):
    import transformers

    src = make_tiny_model("qwen2_bias", tiny_model_root)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    out = LLM(sharded).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    assert out == hf_greedy(src, [PROMPT], 16)[0]


def test_dummy_weights_need_only_a_config(tmp_path, tiny_model_root):
    src = make_tiny_model("llama_gqa", tiny_model_root)
    os.makedirs(tmp_path / "cfg_only")
    with open(os.path.join(src, "config.json")) as f, \
            open(tmp_path / "cfg_only" / "config.json", "w") as g:
        json.dump(json.load(f), g)
    llm = LLM(str(tmp_path / "cfg_only"), load_format="dummy")
    assert llm.engine.tokenizer is None
    assert len(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", GREEDY)


# Largest |log-prob difference| from fp32 on a token both rank in their top 5: about 80 unit
# roundoffs of the dtype (bf16 2^-8, fp16 2^-11). Seen on 12 random tiny models: bf16 0.16,
# fp16 0.018.
HALF_TOLERANCE = {"bfloat16": 0.3, "float16": 0.04}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees_with_fp32(tiny_model_root, dtype):
    src = make_tiny_model("llama_gqa", tiny_model_root)
    llm = LLM(src, dtype=dtype)
    assert llm.engine.kv_cache.dtype == getattr(torch, dtype)
    half = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    # Teacher-forced on half's own tokens, both precisions score the same contexts. Rounding
    # moves each log-prob by at most `tol`, so the token half picks is within 2 * tol of fp32's
    # best: a random tiny model has many near-ties, and a free-running comparison was flaky.
    tol, top = HALF_TOLERANCE[dtype], SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [PROMPT + half[:i] for i in range(len(half))]
    scored = zip(llm.generate(prompts, top), LLM(src).generate(prompts, top), half, strict=True)
    for half_out, fp32_out, token in scored:
        low, full = half_out.outputs[0].logprobs[0], fp32_out.outputs[0].logprobs[0]
        shared = set(low) & set(full)
        assert token in full, (token, full)
        assert max(abs(low[t] - full[t]) for t in shared) < tol, (low, full)
        assert max(full.values()) - full[token] < 2 * tol, (token, full)


def test_missing_model_and_unsupported_architecture_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))


def test_unknown_engine_option_is_refused():
    with pytest.raises(ValueError, match="^EngineConfig: unknown key\\(s\\) not_an_option; known"):
        LLM(None, not_an_option=1)
    with pytest.raises(ValueError, match="^block_size: Input should be greater than or equal to 1"):
        LLM(None, block_size=0)
