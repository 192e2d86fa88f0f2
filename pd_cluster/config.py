"""Engine configuration: what the user sets (EngineConfig, a pydantic model), and the model's
shape read from config.json (ModelConfig)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pd_cluster.config_errors import validate_config
from pd_cluster.models.deepseek_config import (DEEPSEEK_ARCHITECTURES, GroupedRouting, MLAConfig,
                                               deepseek_fields)
from pd_cluster.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:       # torch only where a method needs it: the config imports without it
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                           *DEEPSEEK_ARCHITECTURES)
# Weight quantization an engine can serve (EngineConfig.quantization, ModelConfig.quantization).
SUPPORTED_QUANTIZATION = ("fp8",)
# Checkpoint formats of FP8 weights (config.json quantization_config.quant_method).
FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors")


@dataclass(slots=True)
class ModelConfig:
    """The Llama-family shape, read from a Hugging Face config.json (v4 or v5 layout).

    Mixture of experts (Qwen3-MoE, Mixtral; `num_experts` > 0): the layers `is_moe_layer`
    names replace the gated MLP with `num_experts` experts of `moe_intermediate_size`, each
    token routed to `num_experts_per_tok` of them (pd_cluster/models/moe.py).

    DeepSeek-V2/V3 (`mla` set): multi-head latent attention, its KV cache one latent entry
    per token and layer (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim), and
    `routing`, its grouped router (pd_cluster/models/deepseek_config.py)."""

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
    # "fp8": the linear layers hold FP8 weights (an FP8 checkpoint's as published, or a 16-bit
    # checkpoint's quantized at load); None: the model dtype. The checkpoint's own, from its
    # quantization_config (`checkpoint_quantization`); an engine's `quantization: fp8` sets
    # it with `with_quantization`.
    quantization: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Renormalise the top-k routing weights to sum to 1 (Mixtral always does; Qwen3-MoE as
    # its config says).
    norm_topk_prob: bool = True
    # Layers i with (i + 1) % decoder_sparse_step == 0 are sparse, except mlp_only_layers
    # (Qwen3-MoE's; Mixtral's every layer is sparse).
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mla: MLAConfig | None = None
    routing: GroupedRouting | None = None

    def __post_init__(self) -> None:
        if self.mla is not None and self.quantization == "fp8":
            raise ValueError(f"{self.architecture}: FP8 weights are not supported for "
                             f"DeepSeek models (serve a 16-bit checkpoint without "
                             f"quantization: fp8)")
        if self.num_experts and self.quantization == "fp8":
            # fused_moe has no FP8 weights yet, and 16-bit experts beside FP8 attention would
            # serve a model other than the one asked for.
            raise ValueError(f"{self.architecture}: FP8 experts not supported yet (serve the "
                             f"16-bit checkpoint without quantization: fp8)")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` holds experts (else the dense gated MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_parts(self) -> int:
        """Tensors per layer of the KV cache: K and V, or one latent (MLA)."""
        return 1 if self.mla is not None else 2

    def kv_bytes_per_token(self, itemsize: int, num_kv_heads: int | None = None) -> int:
        """KV cache bytes of one token over every layer (`num_kv_heads`: a rank's own)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return self.kv_parts * self.num_layers * heads * self.head_dim * itemsize

    @property
    def has_dense_layers(self) -> bool:
        """Whether any decoder layer holds the dense gated MLP (of intermediate_size)."""
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

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
        fields = dict(
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            quantization=checkpoint_quantization(cfg.get("quantization_config")),
        )
        # DeepSeek's attention and experts read differently (their fields replace these).
        fields.update(deepseek_fields(arch, cfg) if arch in DEEPSEEK_ARCHITECTURES
                      else _moe_fields(arch, cfg))
        return cls(**fields)

    def with_quantization(self, requested: str | None) -> "ModelConfig":
        """This model as an engine with `quantization: requested` builds it: "fp8" makes the
        linear layers FP8 (a 16-bit checkpoint is then quantized at load); None keeps the
        checkpoint's own (an FP8 checkpoint stays FP8, as vLLM serves it)."""
        if requested is None or requested == self.quantization:
            return self
        if requested not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"unsupported quantization {requested!r}; supported: "
                             f"{', '.join(SUPPORTED_QUANTIZATION)}")
        return dataclasses.replace(self, quantization=requested)


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields of a config.json (none for a dense model)."""
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    # Published Qwen3-MoE configs say num_experts; transformers v5 writes num_local_experts.
    experts = dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                   num_experts_per_tok=cfg["num_experts_per_tok"])
    if arch == "MixtralForCausalLM":    # every layer sparse, its experts intermediate_size wide
        return dict(experts, moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    return dict(experts, moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))


def checkpoint_quantization(qc: dict[str, Any] | None) -> str | None:
    """The weight quantization of a checkpoint's config.json `quantization_config`: None for
    none, "fp8" for FP8 weights with per-tensor or per-channel scales as published (
    quant_method "fp8", vLLM / AutoFP8's; "compressed-tensors" with 8-bit float weights,
    llm-compressor's). Anything else is refused with a ValueError naming it: it could not be
    loaded (AWQ, GPTQ, bitsandbytes, int8, block-wise FP8, ...)."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"checkpoint quantization fp8 with weight_block_size "
                             f"{qc['weight_block_size']}: block-wise FP8 is not supported "
                             f"(per-tensor or per-channel weight scales only)")
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return "fp8"
    raise ValueError(f"checkpoint quantization method {method or qc!r} is not supported; "
                     f"supported: FP8 checkpoints (quant_method "
                     f"{' or '.join(FP8_CHECKPOINT_METHODS)} with float8 weights), or a "
                     f"16-bit checkpoint quantized at load (quantization: fp8)")


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    """A compressed-tensors config we can load: every scheme 8-bit float weights, per tensor
    or per channel, and float (or no) input activations, stored as float8 tensors."""
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (float-quantized "
                         f"FP8 weights only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        w = group.get("weights") or {}
        if (w.get("type"), w.get("num_bits")) != ("float", 8) or \
                w.get("strategy") not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors scheme {name!r}: {w.get('num_bits')}-bit {w.get('type')} "
                f"weights with strategy {w.get('strategy')!r} are not supported (8-bit float "
                f"weights, strategy tensor or channel)")
        a = group.get("input_activations")
        if a and (a.get("type"), a.get("num_bits")) != ("float", 8):
            raise ValueError(f"compressed-tensors scheme {name!r}: {a.get('num_bits')}-bit "
                             f"{a.get('type')} activations are not supported (FP8 or none)")


DEFAULT_MODEL = "default"
# max_model_len when it is unset: the model's context length, at most this many tokens.
MAX_DEFAULT_CONTEXT = 32768
# Every configuration model: unknown keys refused; no coercion (True is no integer, "8" no
# number); immutable once validated, since one config is handed to many replicas.
STRICT_MODEL_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class EngineConfig(BaseModel):
    """Everything an engine needs; defaults suit a laptop CPU and a single GPU alike.

    The `engine:` mapping of the Serve application's args (router/app_config.py) is this
    model; `LLM(path, **fields)` builds one with `EngineConfig.of`. Unknown fields and bad
    values are refused with a ValueError naming the field (pydantic's ValidationError, a
    ValueError too, when constructed directly).
    """

    model_config = STRICT_MODEL_CONFIG

    model: str = Field(DEFAULT_MODEL, min_length=1, description=(
        'a Hugging Face checkpoint directory (safetensors); "default": the bundled '
        "SmolLM2-135M-Instruct"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "auto: float32 on a CPU, the checkpoint's 16-bit type on a GPU"))
    device: str = Field("auto", min_length=1, description=(
        'a torch device ("cpu", "cuda", "cuda:1"); auto: cuda if available, else cpu'))
    load_format: Literal["auto", "dummy"] = Field("auto", description=(
        "auto: safetensors; dummy: random weights from the model's config.json"))
    block_size: int = Field(16, ge=1, description="tokens per KV block, a power of two")
    num_kv_blocks: int | None = Field(None, ge=1, description=(
        "KV blocks of the engine; null: sized from memory"))
    kv_cache_memory_gb: float = Field(1.0, gt=0, description=(
        "KV cache size on a CPU when num_kv_blocks is null"))
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description=(
        "share of a GPU's memory this engine may take (weights, activations, KV), counting "
        "only its own use: engines sharing a GPU each keep to their share"))
    max_model_len: int | None = Field(None, ge=1, description=(
        f"longest sequence, prompt and output; null: the model's context length, at most "
        f"{MAX_DEFAULT_CONTEXT}"))
    max_num_seqs: int = Field(256, ge=1, description="sequences in the running batch")
    max_num_batched_tokens: int = Field(2048, ge=1, description=(
        "token budget of one engine step (chunked prefill)"))
    max_prefill_chunk: int | None = Field(None, ge=1, description=(
        "longest prompt chunk in one step; null: the step's token budget"))
    enable_prefix_caching: bool = Field(True, description=(
        "reuse the KV blocks of prompt prefixes already computed"))
    attention_backend: Literal["auto", "torch", "triton"] = Field("auto", description=(
        "auto: triton on a GPU, torch on a CPU"))
    cuda_graphs: bool = Field(True, description="capture decode steps as CUDA graphs (GPU)")
    async_scheduling: bool | None = Field(None, description=(
        "plan and launch step k+1 before step k's tokens are read; null: on a GPU only (on a "
        "CPU the launch computes the step, so each output would wait one step for nothing)"))
    quantization: Literal["fp8"] | None = Field(None, description=(
        "fp8: FP8 (e4m3) weights, GEMMs on FP8 tensor cores with per-token activation "
        "scales; a 16-bit checkpoint is quantized at load, an FP8 checkpoint loaded as "
        "published; null: the checkpoint's own (an FP8 checkpoint is served as FP8)"))
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description=(
        "auto: the model's dtype; fp8: e4m3 KV with per-layer K and V scales (the "
        "checkpoint's, else calibrated at load), half the bytes of 16-bit KV to store, read "
        "and move from P to D"))
    seed: int = Field(0, description="seed of the random weights of load_format dummy")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "GPUs (ranks) one engine replica spans: heads, MLP and vocabulary split across them; "
        "ranks other than the first run in child processes of the engine's"))
    enable_expert_parallel: bool = Field(False, description=(
        "mixture-of-experts models: each tensor-parallel rank holds num_experts / "
        "tensor_parallel_size whole experts instead of a slice of every expert (attention "
        "stays tensor-parallel)"))
    peer_all_reduce: bool = Field(True, description=(
        "tensor parallel on GPUs that can map each other's memory (NVLink): decode-sized "
        "all-reduces read the other GPUs' buffers directly in one kernel instead of going "
        "through NCCL; false: NCCL for all"))
    speculative: SpeculativeConfig | None = Field(None, description=(
        "speculative decoding on the decoding engine (ngram or draft_model); null: off"))

    @classmethod
    def of(cls, **fields: Any) -> EngineConfig:
        """The config of these fields; a ValueError names each bad or unknown one in a line."""
        return validate_config(cls, fields, "EngineConfig")

    @field_validator("quantization", mode="before")
    @classmethod
    def _known_quantization(cls, value: Any) -> Any:
        if value is not None and value not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"unsupported quantization method {value!r}; supported: "
                             f"{', '.join(SUPPORTED_QUANTIZATION)} (null serves the checkpoint "
                             f"as it is: an FP8 checkpoint as FP8)")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value

    @field_validator("model")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    def torch_device(self, rank: int = 0) -> torch.device:
        """The device of tensor-parallel rank `rank` (on CUDA: the rank-th visible GPU)."""
        import torch

        device = torch.device("cuda" if self.device == "auto" and torch.cuda.is_available()
                              else "cpu" if self.device == "auto" else self.device)
        if device.type == "cuda" and self.tensor_parallel_size > 1:
            # Checked here, before any rank starts: a rank past the last GPU would otherwise
            # fail alone while rank 0 waits out the group's rendezvous timeout.
            first, tp, visible = device.index or 0, self.tensor_parallel_size, \
                torch.cuda.device_count()
            if first + tp > visible:
                raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs from cuda:{first}; "
                                 f"{visible} visible")
            return torch.device("cuda", first + rank)
        return device

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.torch_device().type == "cpu":
            return torch.float32
        return torch.float16 if model.checkpoint_dtype == "float16" else torch.bfloat16


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The engine's max_model_len: as set, else the model's context length capped at
    MAX_DEFAULT_CONTEXT. The router resolves it once and hands it to every engine, so that
    its prompt limits and the engines' agree."""
    return config.max_model_len or min(model.max_position_embeddings, MAX_DEFAULT_CONTEXT)
