"""Greedy reference continuations from Hugging Face transformers."""
from __future__ import annotations

import os

import torch

# (model_dir, its config's mtime, dtype, prompt) -> the longest greedy continuation made so
# far. Greedy decoding is deterministic and the first n tokens of a longer continuation are
# the n-token continuation, so modules that ask for the same tiny model's continuations (the
# engine against HF, with and without tensor parallelism) pay for `generate` once a session.
_CONTINUATIONS: dict[tuple, list[int]] = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Each prompt alone through `generate`, greedy, EOS disabled (as with ignore_eos)."""
    stamp = os.path.getmtime(os.path.join(model_dir, "config.json"))
    keys = [(os.path.abspath(model_dir), stamp, dtype, tuple(p)) for p in prompts]
    missing = [i for i, k in enumerate(keys)
               if len(_CONTINUATIONS.get(k, ())) < max_new_tokens]
    if missing:
        for i, out in zip(missing, _generate(model_dir, [prompts[i] for i in missing],
                                             max_new_tokens, dtype)):
            _CONTINUATIONS[keys[i]] = out
    return [_CONTINUATIONS[k][:max_new_tokens] for k in keys]


def _generate(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        o = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs
