"""Time the README's first Quickstart command as a new user meets it, and print JSON.

    python -m bench.quickstart_time [--port 8000] [--timeout-s 1800]

Clones this repository's HEAD into an empty temporary directory, makes a fresh virtualenv
there, and runs the first command of the README's Quickstart in the clone exactly as written
(with pip's cache off and an empty model cache, so the default model is fetched and converted
too). It reports when pip finished installing and the virtualenv's size then, what every
request sent during start-up got (status, how long it took to answer), when the service said
it was ready and when it first answered "The capital of France is" and what it said, whether
the install brought `llama-cpp-python` or `llm`; then it presses Ctrl-C (SIGINT to the
command's process group, as a terminal does) and reports how long the command took to exit
and every warning or error line it printed meanwhile. The directory is removed.
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
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8,
          "temperature": 0}
UNWANTED = ("llama-cpp-python", "llama_cpp_python", "llm")
READY_LINE = "pd-cluster is ready"
# What a line said after Ctrl-C must not say.
TROUBLE = re.compile(r"WARNING|ERROR|Error|Traceback|failed")


def quickstart_command(readme: Path) -> str:
    """The first ```bash block under '## Quickstart'."""
    section = readme.read_text().split("## Quickstart", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()


def ask(port: int) -> tuple[str | None, str]:
    """(the completion's text or None, what the service answered: a status code or why not)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(PROMPT).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)["choices"][0]["text"], str(response.status)
    except urllib.error.HTTPError as e:
        return None, str(e.code)
    except (OSError, ValueError, KeyError) as e:
        return None, type(getattr(e, "reason", e)).__name__


def watch(process: subprocess.Popen, marks: dict[str, float], start: float, log,
          after_stop: list[str]) -> None:
    """Copy the command's output to `log`, noting when pip finished, when the service said it
    was ready, and what it printed after Ctrl-C."""
    for line in process.stdout:
        log.write(line)
        if line.startswith("Successfully installed") and "install_s" not in marks:
            marks["install_s"] = time.monotonic() - start
        if READY_LINE in line and "ready_line_s" not in marks:
            marks["ready_line_s"] = time.monotonic() - start
        if "stop_at" in marks and TROUBLE.search(line):
            after_stop.append(line.strip()[:300])


def megabytes(path: Path) -> float:
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return round(int(done.stdout.split()[0]) / 1e6)


def run(port: int, timeout_s: float, log_path: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        clone, venv = Path(tmp) / "pd-cluster", Path(tmp) / "venv"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        venv_base_mb = megabytes(venv)
        command = quickstart_command(clone / "README.md")
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
               "VIRTUAL_ENV": str(venv), "PIP_NO_CACHE_DIR": "1",
               "PD_CLUSTER_CACHE": str(Path(tmp) / "cache")}
        marks: dict[str, float] = {}
        after_stop: list[str] = []
        answers: list[dict] = []
        venv_mb = None
        start = time.monotonic()
        process = subprocess.Popen(["bash", "-c", command], cwd=clone, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        with open(log_path, "w") as log:
            reader = threading.Thread(target=watch,
                                      args=(process, marks, start, log, after_stop))
            reader.start()
            answer = None
            while answer is None and process.poll() is None \
                    and time.monotonic() - start < timeout_s:
                time.sleep(2)
                if "install_s" not in marks:
                    continue
                if venv_mb is None:
                    venv_mb = megabytes(venv)
                asked = time.monotonic()
                answer, status = ask(port)
                answers.append({"at_s": _round(asked - start), "answer": status,
                                "took_s": _round(time.monotonic() - asked)})
            answered_s = time.monotonic() - start if answer is not None else None
            installed = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=json"],
                                       capture_output=True, text=True).stdout
            time.sleep(2)               # the answer's own log lines come before Ctrl-C
            marks["stop_at"] = time.monotonic()
            stopped_by = _stop(process)
            stop_s = time.monotonic() - marks["stop_at"]
            reader.join(timeout=60)
        names = {p["name"].lower() for p in json.loads(installed or "[]")}
        return {"command": command, "install_s": _round(marks.get("install_s")),
                "venv_mb": None if venv_mb is None else venv_mb - venv_base_mb,
                "ready_line_s": _round(marks.get("ready_line_s")),
                "first_answer_s": _round(answered_s), "answer": answer,
                "start_up_answers": _distinct(answers),
                "slowest_start_up_answer_s": max((a["took_s"] for a in answers), default=None),
                "ctrl_c_exit_s": _round(stop_s), "ctrl_c_needed_sigkill": stopped_by != "SIGINT",
                "lines_after_ctrl_c_with_warnings_or_errors": after_stop,
                "unwanted_packages_installed": sorted(names & set(UNWANTED)),
                "packages_installed": len(names), "exit_code": process.returncode}


def _distinct(answers: list[dict]) -> list[dict]:
    """The first answer of each kind (status), in order, and how many of that kind came."""
    kinds: dict[str, dict] = {}
    for a in answers:
        kinds.setdefault(a["answer"], {**a, "count": 0})["count"] += 1
    return list(kinds.values())


def _stop(process: subprocess.Popen) -> str | None:
    """SIGINT first (`serve run` then shuts down the Ray it started), SIGKILL if it lingers;
    the signal that ended it (None: it had ended already)."""
    for sig, wait_s in ((signal.SIGINT, 90), (signal.SIGKILL, 30)):
        if process.poll() is not None:
            return None
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
            return sig.name
        except subprocess.TimeoutExpired:
            continue
    return None


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
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    result.update(date=datetime.date.today().isoformat(), commit=commit,
                  machine=platform.machine(), cpus=os.cpu_count(),
                  python=platform.python_version(),
                  bench_command="python bench/quickstart_time.py")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
