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
# Qwen3-30B-A3B's published config.json (what transformers' Qwen3MoeConfig and our loader read):
# 48 layers, every one sparse, of 128 experts (top-8, renormalized); 32 query heads of 128 over
# a hidden size of 2048, so head_dim is not hidden / heads. intermediate_size is the dense MLP's,
# which no layer has (mlp_only_layers is empty).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
# Its CPU-sized cut (tests run bench/tp_bench.py's MoE path on it): 8 experts, top 2, and the
# whole vocabulary, since the benchmarks draw token ids up to 120000.
TINY_QWEN3_MOE = {**QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
                  "num_experts_per_tok": 2, "max_position_embeddings": 4096,
                  "torch_dtype": "float32"}
# DeepSeek-V2-Lite's published config.json (15.7B): multi-head latent attention (16 heads, no
# q-LoRA, a latent of 512 plus a 64-wide RoPE key cached a token and layer), 26 sparse layers
# of 64 routed experts (top-6, softmax, not renormalized) and 2 shared ones after one dense.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True,
    "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "initializer_range": 0.02, "use_cache": True,
    "torch_dtype": "bfloat16",
}
# Its CPU-sized cut (tests run bench/tp_bench.py's DeepSeek path on it): the published widths
# of attention shrunk, 8 experts of which 2 routed and 1 shared, the whole vocabulary.
TINY_DEEPSEEK_V2 = {**DEEPSEEK_V2_LITE, "hidden_size": 64, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "max_position_embeddings": 4096, "torch_dtype": "float32"}
SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B, "tiny-llama": TINY_LLAMA,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny-qwen3-moe": TINY_QWEN3_MOE,
          "deepseek-v2-lite": DEEPSEEK_V2_LITE, "tiny-deepseek-v2": TINY_DEEPSEEK_V2}


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


def params_bytes(cfg: dict, itemsize: int = 2, linear_itemsize: int | None = None) -> int:
    """Bytes of weights one decode step reads whatever its tokens (embedding rows aside: one
    row per token): a dense model's all; a mixture of experts' all but the experts (attention,
    routers, norms, any dense layer's MLP, lm_head), whose routed share `decode_weight_bytes`
    adds. `linear_itemsize`: of the decoder layers' linear weights when it differs (FP8: 1,
    their per-channel float32 scales counted; the norms, routers and lm_head keep `itemsize`)."""
    if is_deepseek(cfg):
        if linear_itemsize is not None:
            raise ValueError("FP8 DeepSeek weights: no roofline")
        return _deepseek_params_bytes(cfg, itemsize)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    layers, sparse = cfg["num_hidden_layers"], moe_layers(cfg)
    li = itemsize if linear_itemsize is None else linear_itemsize
    scale = 0 if linear_itemsize is None else 4             # one per output channel
    attention = (h * (heads + 2 * kv) * d + heads * d * h) * li + scale * ((heads + 2 * kv) * d + h)
    norms = 2 * h * itemsize + (2 * d * itemsize if _qk_norm(cfg) else 0)
    mlp = 3 * h * i * li + scale * (2 * i + h)
    router = num_experts(cfg) * h * itemsize
    return (layers * (attention + norms) + (layers - sparse) * mlp + sparse * router
            + (v * h + h) * itemsize)


def kv_bytes_per_token(cfg: dict, itemsize: int = 2) -> int:
    """All layers' cache bytes a token: a latent cache holds one kv_lora_rank + RoPE-dim entry
    a layer (whole on every tensor-parallel rank), others a K and a V a KV head."""
    if is_deepseek(cfg):
        return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * itemsize
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim(cfg) * itemsize


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _qk_norm(cfg: dict) -> bool:
    return cfg["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


# -- mixtures of experts ------------------------------------------------------------------------
# A MoE decode step reads, per sparse layer, the experts its tokens route to: their union over
# the batch, not all of them (at Qwen3-30B-A3B's 128 experts, top-8, batch 64 routes to about
# 126). Dummy weights route nearly uniformly: random router rows against hidden states of
# random tokens favour no expert. bench/tp_bench.py also counts the experts actually routed
# (pd_cluster/models/moe.py's counters) and bases its roofline on those.


def num_experts(cfg: dict) -> int:
    """Routed experts per sparse layer (0: a dense model); Mixtral's config says
    num_local_experts, DeepSeek's n_routed_experts."""
    return (cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
            or 0)


def moe_layers(cfg: dict) -> int:
    """The decoder layers holding experts (pd_cluster/config.py ModelConfig.is_moe_layer)."""
    if not num_experts(cfg):
        return 0
    if is_deepseek(cfg):        # pd_cluster/models/deepseek_config.py deepseek_fields
        first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
        return sum(1 for i in range(cfg["num_hidden_layers"]) if i >= first and i % freq == 0)
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return sum(1 for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def expert_bytes(cfg: dict, itemsize: int = 2) -> int:
    """One expert's gate, up and down projections (Mixtral's experts are intermediate_size
    wide)."""
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return 3 * cfg["hidden_size"] * inter * itemsize


def expected_routed_experts(experts: int, top_k: int, tokens: int,
                            local: int | None = None) -> float:
    """The expected number of distinct experts (of `local` of them, default all) that `tokens`
    tokens route to, each token to `top_k` distinct ones of `experts`, uniformly: a token
    picks a given expert with probability K/E, so E_local * (1 - (1 - K/E)^T)."""
    return (experts if local is None else local) * (1 - (1 - top_k / experts) ** tokens)


def decode_weight_bytes(cfg: dict, tokens: int, tp: int = 1, expert_parallel: bool = False,
                        routed: float | None = None, itemsize: int = 2,
                        linear_itemsize: int | None = None) -> float:
    """Bytes of weights one GPU reads for a decode step of `tokens` tokens: its 1/tp of
    `params_bytes` and, of a MoE model, of each sparse layer's routed experts. Under tensor
    parallelism a GPU reads its 1/tp slice of every routed expert; under expert parallelism
    (tp ranks) the whole of those routed among its E/tp. `routed`: the experts per layer that
    GPU reads (measured; under expert parallelism the busiest rank's), else the uniform
    routing's expectation (`expected_routed_experts`)."""
    base = params_bytes(cfg, itemsize, linear_itemsize) / tp
    experts = num_experts(cfg)
    if not experts:
        return base
    local = experts // tp if expert_parallel else experts
    if routed is None:
        routed = expected_routed_experts(experts, cfg["num_experts_per_tok"], tokens, local)
    per_expert = expert_bytes(cfg, itemsize) / (1 if expert_parallel else tp)
    return base + moe_layers(cfg) * routed * per_expert


def resident_weight_bytes(cfg: dict, tp: int = 1, itemsize: int = 2) -> float:
    """Bytes of weights one GPU holds, embedding aside: `params_bytes` / tp plus its share
    of all the experts (a 16-bit model; EP or TP, each GPU holds 1/tp of them)."""
    return (params_bytes(cfg, itemsize)
            + moe_layers(cfg) * num_experts(cfg) * expert_bytes(cfg, itemsize)) / tp


# -- DeepSeek-V2/V3 --------------------------------------------------------------------------


def is_deepseek(cfg: dict) -> bool:
    return cfg["architectures"][0] in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _deepseek_params_bytes(cfg: dict, itemsize: int) -> int:
    """`params_bytes` of a DeepSeek model (pd_cluster/models/mla.py, deepseek_moe.py): per
    layer multi-head latent attention (q_proj, or q-LoRA's q_a_proj, norm and q_b_proj;
    kv_a_proj_with_mqa, the latent's norm, kv_b_proj, o_proj) and two norms; the dense
    layers' MLP; the sparse layers' fp32 router (DeepSeek keeps the gate in fp32), V3's
    routing bias, and shared experts of moe_intermediate_size each. At tp > 1 the replicated
    kv_a_proj_with_mqa and router are counted as split (the roofline is for tp 1)."""
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    latent, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, vd, q_lora = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg.get("q_lora_rank")
    q_out = heads * (nope + rope)
    q = h * q_out if q_lora is None else h * q_lora + q_lora + q_lora * q_out
    attention = (q + h * (latent + rope) + latent + latent * heads * (nope + vd)
                 + heads * vd * h) * itemsize
    layers, sparse, experts = cfg["num_hidden_layers"], moe_layers(cfg), num_experts(cfg)
    mlp = 3 * h * cfg["intermediate_size"] * itemsize
    bias = experts if cfg.get("topk_method") == "noaux_tc" or (
        cfg["architectures"][0] == "DeepseekV3ForCausalLM" and not cfg.get("topk_method")) else 0
    router = (experts * h + bias) * 4
    shared = (cfg.get("n_shared_experts") or 0) * expert_bytes(cfg, itemsize)
    return (layers * (attention + 2 * h * itemsize) + (layers - sparse) * mlp
            + sparse * (router + shared) + (v * h + h) * itemsize)


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


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write a dummy model directory; print its path")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer-from", default=None)
    a = ap.parse_args()
    print(dummy_model_dir(a.shape, a.tokenizer_from))
