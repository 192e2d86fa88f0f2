"""Engine configuration: what the user sets, and the model's shape read from config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class ModelConfig:
    """The Llama-family shape, read from a Hugging Face config.json (v4 or v5 layout)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    checkpoint_dtype: str

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        # transformers v5 moved rope settings into `rope_parameters`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs; defaults suit a laptop CPU and a single GPU alike."""

    model: str | None = None              # a model directory; None = the bundled default model
    dtype: str = "auto"                   # auto: fp32 on CPU, the checkpoint's 16-bit type on GPU
    device: str = "auto"                  # auto: cuda if available, else cpu
    load_format: str = "auto"             # auto: safetensors; dummy: random weights
    block_size: int = 16
    num_kv_blocks: int | None = None      # None: sized from memory
    kv_cache_memory_gb: float = 1.0       # CPU pool size when num_kv_blocks is None
    gpu_memory_utilization: float = 0.85  # fraction of GPU memory for weights + activations + KV
    max_model_len: int | None = None      # None: the model's max_position_embeddings (cap 32k)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int | None = None  # longest prompt chunk per step (None: the budget)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"       # auto | torch | triton
    cuda_graphs: bool = True
    # Plan and launch step k+1 before step k's tokens are read. None: on a GPU only (on a CPU
    # the "launch" computes the step, so each output would wait one more step for nothing).
    async_scheduling: bool | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"EngineConfig.dtype must be auto or one of {list(_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"EngineConfig.load_format must be auto or dummy, "
                             f"got {self.load_format!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"EngineConfig.attention_backend must be auto, torch or triton, "
                             f"got {self.attention_backend!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32
        return torch.float16 if model.checkpoint_dtype == "float16" else torch.bfloat16
