"""Loading: sharded safetensors, dummy weights, dtypes, and clear errors."""
import json
import os

import pytest
import torch

from hf_reference import hf_greedy
from pd_cluster import LLM, SamplingParams
from tiny_models import make_tiny_model

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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees_with_fp32(tiny_model_root, dtype):
    src = make_tiny_model("llama_gqa", tiny_model_root)
    llm = LLM(src, dtype=dtype)
    assert llm.engine.kv_cache.dtype == getattr(torch, dtype)
    half = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    # Teacher-forced on half's own tokens, fp32 ranks every one of them at or next to its
    # best: rounding only flips near-ties (a tiny random model has many, so comparing the
    # two free-running sequences token by token was flaky).
    fp32, top = LLM(src), SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [PROMPT + half[:i] for i in range(len(half))]
    for out, token in zip(fp32.generate(prompts, top), half, strict=True):
        ranked = out.outputs[0].logprobs[0]
        best = max(ranked.values())
        assert token in ranked and best - ranked[token] < 0.05, (token, ranked)


def test_missing_model_and_unsupported_architecture_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))


def test_unknown_engine_option_is_refused():
    with pytest.raises(TypeError):
        LLM(None, not_an_option=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(None, block_size=0)
