"""Builds a model on its device and fills it from safetensors files or random values."""
from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open

from kernels.fp8_math import FP8
from pd_cluster.config import ModelConfig
from pd_cluster.models.deepseek import DeepseekForCausalLM
from pd_cluster.models.llama import LlamaForCausalLM


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every (possibly sharded) *.safetensors file in the directory."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r} "
                                f"(use load_format='dummy' for random weights)")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _init_dummy(model: torch.nn.Module, seed: int, device: torch.device,
                dtype: torch.dtype) -> None:
    # Small normal weights keep activations sane through many layers; norms stay at 1.
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("weight_scale"):     # scales: set with weights
                continue
            full = getattr(p, "full_shape", tuple(p.shape))
            if full == tuple(p.shape) and p.dtype != FP8:   # the whole tensor (tp = 1)
                p.normal_(0, 0.02, generator=gen)
            else:
                # A tensor-parallel shard: every rank draws the whole tensor from the same
                # seed and keeps its slice, so the ranks' shards make one model (tp = 1's).
                # An FP8 weight: drawn in the model dtype and quantized by its loader, as a
                # 16-bit checkpoint's would be.
                whole = torch.empty(full, dtype=dtype if p.dtype == FP8 else p.dtype,
                                    device=device)
                p.weight_loader(p, whole.normal_(0, 0.02, generator=gen))


# Models this process has built: an engine replica reports it (ReplicaLoad.model_loads), so a
# role change can be seen to keep its weights rather than load them again.
_loads = 0


def model_loads() -> int:
    """How many models this process has built (load_model calls)."""
    return _loads


def load_model(model_dir: str | None, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
               device: torch.device, load_format: str, seed: int,
               quantization: str | None = None,
               expert_parallel: bool = False) -> LlamaForCausalLM | DeepseekForCausalLM:
    """The model of `cfg` on `device` in `dtype`, its weights from `model_dir`'s safetensors
    or random (load_format "dummy"). `quantization` is the engine's (EngineConfig's): "fp8"
    builds FP8 linear layers whatever the checkpoint holds (16-bit weights are quantized at
    load); None builds what the checkpoint is (`cfg.quantization`: FP8 for an FP8 one).
    `expert_parallel` (EngineConfig.enable_expert_parallel): a MoE model's experts whole
    over the tensor-parallel ranks."""
    global _loads
    _loads += 1
    cfg = cfg.with_quantization(quantization)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model_class = LlamaForCausalLM if cfg.mla is None else DeepseekForCausalLM
            model = model_class(cfg, max_positions, expert_parallel)
    finally:
        torch.set_default_dtype(torch.float32)
    if load_format == "dummy":
        _init_dummy(model, seed, device, dtype)
    else:
        model.load_weights(iter_safetensors(model_dir))
    return model.eval()
