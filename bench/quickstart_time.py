"""Time the README's first Quickstart command as a new user meets it, and print JSON.

    python bench/quickstart_time.py [--port 8000] [--timeout-s 1800]

Clones this repository's HEAD into an empty temporary directory, makes a fresh virtualenv
there, and runs the first command of the README's Quickstart in the clone exactly as written
(with pip's cache off and an empty model cache, so the default model is fetched and converted
too). It reports when pip finished installing, when the service first answered "The capital of
France is" over HTTP and what it said, and whether the install brought `llama-cpp-python` or
`llm`. The service is then stopped and the directory removed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8,
          "temperature": 0}
UNWANTED = ("llama-cpp-python", "llama_cpp_python", "llm")


def quickstart_command(readme: Path) -> str:
    """The first ```bash block under '## Quickstart'."""
    section = readme.read_text().split("## Quickstart", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()


def ask(port: int) -> str | None:
    """The completion's text, or None while the service does not answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(PROMPT).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)["choices"][0]["text"]
    except (OSError, ValueError, KeyError):
        return None


def watch(process: subprocess.Popen, marks: dict[str, float], start: float, log) -> None:
    """Copy the command's output to `log`, noting when pip finished."""
    for line in process.stdout:
        log.write(line)
        if line.startswith("Successfully installed") and "install_s" not in marks:
            marks["install_s"] = time.monotonic() - start


def run(port: int, timeout_s: float, log_path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        clone, venv = Path(tmp) / "pd-cluster", Path(tmp) / "venv"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        command = quickstart_command(clone / "README.md")
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
               "VIRTUAL_ENV": str(venv), "PIP_NO_CACHE_DIR": "1",
               "PD_CLUSTER_CACHE": str(Path(tmp) / "cache")}
        marks: dict[str, float] = {}
        start = time.monotonic()
        process = subprocess.Popen(["bash", "-c", command], cwd=clone, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        with open(log_path, "w") as log:
            reader = threading.Thread(target=watch, args=(process, marks, start, log))
            reader.start()
            answer = None
            while answer is None and process.poll() is None \
                    and time.monotonic() - start < timeout_s:
                time.sleep(2)
                answer = ask(port) if "install_s" in marks else None
            answered_s = time.monotonic() - start if answer is not None else None
            installed = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=json"],
                                       capture_output=True, text=True).stdout
            _stop(process)
            reader.join(timeout=60)
        names = {p["name"].lower() for p in json.loads(installed or "[]")}
        return {"command": command, "install_s": _round(marks.get("install_s")),
                "first_answer_s": _round(answered_s), "answer": answer,
                "unwanted_packages_installed": sorted(names & set(UNWANTED)),
                "packages_installed": len(names), "exit_code": process.returncode}


def _stop(process: subprocess.Popen) -> None:
    """SIGINT first (`serve run` then shuts down the Ray it started), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGINT, 90), (signal.SIGKILL, 30)):
        if process.poll() is not None:
            return
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="the port configs/pd.yaml serves")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--log", type=Path, default=Path("quickstart_time.log"),
                        help="where the command's own output goes")
    args = parser.parse_args()
    result = run(args.port, args.timeout_s, args.log)
    result.update(date=datetime.date.today().isoformat(), machine=platform.machine(),
                  cpus=os.cpu_count(), python=platform.python_version(),
                  bench_command="python bench/quickstart_time.py")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
