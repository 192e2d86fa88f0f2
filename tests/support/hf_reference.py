"""Greedy reference continuations from Hugging Face transformers."""
from __future__ import annotations

import torch


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Each prompt alone through `generate`, greedy, EOS disabled (as with ignore_eos)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        o = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs
