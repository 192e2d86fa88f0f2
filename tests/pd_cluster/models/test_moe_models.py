"""Mixture-of-experts models (Qwen3-MoE, Mixtral; pd_cluster/models/moe.py): their config,
both checkpoint layouts of the experts, the refusals, and two CPU ranks (gloo) computing the
logits of one rank with the experts split by intermediate dimension (tensor parallel) or
whole (expert parallel). Greedy output against transformers: tests/pd_cluster/test_engine_matches_hf.py
(tp = 1) and tests/pd_cluster/test_tensor_parallel_engine.py (tp = 2, with and without expert
parallelism) run these families too."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from functools import partial
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import tp_ranks as tp_model
from pd_cluster.config import ModelConfig
from pd_cluster.distributed import check_tp, get_tp
from pd_cluster.models.loader import load_model
from tests.support.tp_ranks import rank_cases, run_ranks
from tests.support.tiny_models import make_tiny_model

MOE_FAMILIES = ["qwen3_moe", "mixtral"]
# (family, mode): a checkpoint or random weights ("dummy"), experts sliced or whole ("-ep").
TP_CASES = [("qwen3_moe", "auto"), ("qwen3_moe", "auto-ep"), ("mixtral", "auto"),
            ("mixtral", "auto-ep"), ("mixtral", "dummy-ep")]


def logits_of(model_dir: str, mode: str) -> torch.Tensor:
    """tests/pd_cluster/models/test_tensor_parallel_model.py's two steps of logits; `mode` is the load format,
    with "-ep" for expert parallelism."""
    load_format, _, ep = mode.partition("-")

    def load(*args):
        model = load_model(*args, expert_parallel=ep == "ep")
        experts, ranks = model.layers[0].mlp.experts, get_tp().size
        # Whole experts, a share of them; or a slice of every one.
        assert (experts.num_local, experts.inter_local) == (
            (experts.num_experts // ranks, experts.intermediate) if ep else
            (experts.num_experts, experts.intermediate // ranks))
        return model

    with mock.patch.object(tp_model, "load_model", load):
        return tp_model.two_steps_logits(model_dir, load_format)


def _rank_main(rank: int, init_method: str, cases: list[tuple[str, str, str]],
               out_dir: str) -> None:
    rank_cases(rank, init_method, cases, out_dir, logits_of)


@pytest.fixture(scope="module")
def rank_outputs(tiny_model_root, tmp_path_factory) -> str:
    out_dir = str(tmp_path_factory.mktemp("moe_ranks"))
    cases = [(f"{f}-{mode}", make_tiny_model(f, tiny_model_root), mode) for f, mode in TP_CASES]
    run_ranks(_rank_main, cases, out_dir)
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", TP_CASES)
def test_two_ranks_give_the_logits_of_one(family, mode, rank_outputs, tiny_model_root):
    expected = logits_of(make_tiny_model(family, tiny_model_root), mode.replace("-ep", ""))
    for rank in range(tp_model.TP):
        stem = os.path.join(rank_outputs, f"{family}-{mode}.rank{rank}")
        if os.path.exists(stem + ".err"):
            pytest.fail(f"rank {rank} failed:\n" + open(stem + ".err").read())
        # Only the order of the sums differs (each rank's partial sums, then all_reduce).
        torch.testing.assert_close(torch.load(stem + ".pt"), expected, rtol=1e-4, atol=1e-5)


def test_config_names_the_sparse_layers(tiny_model_root):
    qwen = ModelConfig.from_dir(make_tiny_model("qwen3_moe", tiny_model_root))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (4, 2, 32)
    assert qwen.norm_topk_prob and qwen.qk_norm
    assert [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]   # mlp_only_layers
    assert qwen.has_dense_layers
    mixtral = ModelConfig.from_dir(make_tiny_model("mixtral", tiny_model_root))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 128)
    assert mixtral.norm_topk_prob and not mixtral.has_dense_layers
    # Published Qwen3-MoE configs name the count num_experts; every second layer sparse.
    with open(os.path.join(make_tiny_model("qwen3_moe", tiny_model_root), "config.json")) as f:
        raw = json.load(f)
    raw = {**raw, "num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": []}
    published = ModelConfig.from_dict(raw)
    assert published.num_experts == 8
    assert [published.is_moe_layer(i) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fused_expert_tensors_load_as_the_per_expert_ones(family, tiny_model_root, tmp_path):
    """transformers v5's 3D experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) give the
    same model as the per-expert tensors save_pretrained writes."""
    source = make_tiny_model(family, tiny_model_root)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    fused, experts = {}, {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            fused[name] = t
            continue
        expert, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(proj, {})[int(expert)] = t
    for head, projs in experts.items():
        stack = lambda p: torch.stack([projs[p][e] for e in sorted(projs[p])])  # noqa: E731
        gate, up, down = (("gate_proj", "up_proj", "down_proj") if "gate_proj" in projs
                          else ("w1", "w3", "w2"))
        fused[f"{head}.experts.gate_up_proj"] = torch.cat([stack(gate), stack(up)], dim=1)
        fused[f"{head}.experts.down_proj"] = stack(down)
    shutil.copy(os.path.join(source, "config.json"), tmp_path)
    save_file(fused, os.path.join(tmp_path, "model.safetensors"))
    cfg = ModelConfig.from_dir(source)
    load = partial(load_model, cfg=cfg, max_positions=64, dtype=torch.float32,
                   device=torch.device("cpu"), load_format="auto", seed=0)
    want, got = load(source).state_dict(), load(str(tmp_path)).state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fp8_experts_are_refused(family, tiny_model_root):
    cfg = ModelConfig.from_dir(make_tiny_model(family, tiny_model_root))
    with pytest.raises(ValueError, match="FP8 experts not supported yet"):
        cfg.with_quantization("fp8")


def test_check_tp_names_what_does_not_split(tiny_model_root):
    cfg = ModelConfig.from_dir(make_tiny_model("qwen3_moe", tiny_model_root))
    check_tp(cfg, 2)
    check_tp(cfg, 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts \(4\) is not divisible by the expert "
                                         r"parallel size \(8\)"):
        check_tp(dataclasses.replace(cfg, num_heads=8, num_kv_heads=8), 8, expert_parallel=True)
    odd = dataclasses.replace(cfg, moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"intermediate size \(30\) is not divisible by the "
                                         r"tensor parallel size \(4\); enable_expert_parallel"):
        check_tp(odd, 4)
    check_tp(odd, 4, expert_parallel=True)      # whole experts: their width does not matter

