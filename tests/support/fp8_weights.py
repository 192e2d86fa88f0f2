"""FP8 checkpoints as published, and the relative error the FP8 tests compare with."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_math import FP8
from pd_cluster.models import fp8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: str, dst: str, fmt: str) -> dict[str, torch.Tensor]:
    """An FP8 copy of the 16-bit checkpoint `src` in `dst`, as published (returns its tensors):
      fp8-tensor: quant_method "fp8" (AutoFP8 / vLLM): one float32 scale per tensor (shape
          []), static activation scales (input_scale), KV scales self_attn.k_scale / v_scale;
      ct-channel: compressed-tensors FP8_DYNAMIC: a float32 scale per output channel
          ([out, 1]), dynamic per-token activations, no KV scales;
      ct-tensor: compressed-tensors, one bf16 scale per tensor ([1]), static activations,
          KV scales as k_proj / v_proj.output_scale."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEAR:
            out[name] = t
            continue
        stem = name.removesuffix(".weight")
        if fmt == "ct-channel":
            w8, scale = fp8.quantize_weight(t)
            scale = scale[:, None]
        else:
            scale = (t.abs().max() / 448.0).reshape(() if fmt == "fp8-tensor" else (1,))
            if fmt == "ct-tensor":
                scale = scale.bfloat16()
            w8 = (t / scale.float()).clamp(-448, 448).to(FP8)
        out[name], out[stem + ".weight_scale"] = w8, scale
        if fmt != "ct-channel":
            out[stem + ".input_scale"] = torch.rand((), generator=gen).reshape(scale.shape)
    cfg = json.load(open(os.path.join(src, "config.json")))
    for layer in range(cfg["num_hidden_layers"]):
        attn = f"model.layers.{layer}.self_attn."
        k, v = torch.tensor(0.01 * (layer + 1)), torch.tensor(0.02 * (layer + 1))
        if fmt == "fp8-tensor":
            out[attn + "k_scale"], out[attn + "v_scale"] = k, v
        elif fmt == "ct-tensor":
            out[attn + "k_proj.output_scale"] = k.reshape(1)
            out[attn + "v_proj.output_scale"] = v.reshape(1)
    if fmt == "fp8-tensor":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                      "ignored_layers": ["lm_head"]}
    else:
        static = fmt == "ct-tensor"
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "kv_cache_scheme": ({"num_bits": 8, "type": "float", "strategy": "tensor",
                                 "dynamic": False, "symmetric": True} if static else None),
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                            "strategy": "tensor" if static else "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "strategy": "tensor" if static else "token",
                                      "dynamic": not static}}}}
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out
