"""Model shapes for benchmarks: config.json directories for `load_format="dummy"`."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672,
                "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
# A CPU-sized Llama over SmolLM2's 49,152-token vocabulary (scripts' smoke runs).
TINY_LLAMA = {**LLAMA_31_8B, "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "rope_scaling": None, "torch_dtype": "float32"}
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B, "tiny-llama": TINY_LLAMA}


def dummy_model_dir(shape: str = "llama-3.1-8b", tokenizer_from: str | None = None) -> str:
    """A directory holding the config.json of a named shape (weights come from dummy init),
    plus the tokenizer files of `tokenizer_from` when given (the HTTP router needs one)."""
    path = os.path.join(tempfile.gettempdir(), f"pd-cluster-dummy-{shape}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f)
    if tokenizer_from:
        for name in os.listdir(tokenizer_from):
            if name.startswith("tokenizer") or name == "generation_config.json":
                shutil.copy(os.path.join(tokenizer_from, name), path)
    return path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write a dummy model directory; print its path")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer-from", default=None)
    a = ap.parse_args()
    print(dummy_model_dir(a.shape, a.tokenizer_from))


def params_bytes(cfg: dict, itemsize: int = 2, linear_itemsize: int | None = None) -> int:
    """Bytes of weights one decode step reads (embedding rows aside: one row per token);
    `linear_itemsize`: of the decoder layers' linear weights when it differs (FP8: 1, their
    per-channel float32 scales counted; the norms and lm_head keep `itemsize`)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    linear = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i
    outputs = (heads + 2 * kv) * d + h + 2 * i + h          # one scale per output channel
    li = itemsize if linear_itemsize is None else linear_itemsize
    scales = 0 if linear_itemsize is None else 4 * outputs
    layer = linear * li + scales + 2 * h * itemsize
    return cfg["num_hidden_layers"] * layer + (v * h + h) * itemsize


def kv_bytes_per_token(cfg: dict, itemsize: int = 2) -> int:
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * itemsize


def word_tokenizer(path: str, vocab_size: int) -> str:
    """A word-level tokenizer of `vocab_size` ids in `path` (tokenizer.json and its config),
    for a dummy model served through HTTP where no real tokenizer of its vocabulary can be
    fetched: the load generator's words first (so its prompts are a token a word), then
    fillers `w<id>`. Generated text reads as those words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from pd_cluster.benchmark.loadgen import _WORDS

    words = ["<unk>", "<s>", "</s>"] + sorted(set(_WORDS))
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>"}, f)
    return path
