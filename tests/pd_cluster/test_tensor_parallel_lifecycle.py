"""A tensor-parallel engine's lifecycle in the user's process, on the CPU (gloo, 2 ranks):

- a script that builds `LLM(..., tensor_parallel_size=2)` at module level, without an
  `if __name__ == "__main__":` guard, runs (the rank processes do not re-run it);
- engines built one after another in one process: after `close()`, and after the last
  reference is dropped, the next one starts and gives the same text;
- a second engine while one is alive is refused at once, with what to do.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from pd_cluster import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
ENGINE = dict(block_size=4, num_kv_blocks=64, tensor_parallel_size=2)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_a_script_without_a_main_guard_runs(tmp_path, tiny_model_root):
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from pd_cluster import LLM, SamplingParams
        print("module body ran", flush=True)
        llm = LLM({model_dir!r}, **{ENGINE!r})
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))
        print("tokens", out[0].outputs[0].token_ids, flush=True)
    """))
    began = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("module body ran") == 1     # not again in the rank's process
    assert "tokens [" in done.stdout
    assert time.monotonic() - began < 120


def test_engines_one_after_another_after_close_and_after_the_last_reference_goes(
        tiny_model_root):
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    with LLM(model_dir, **ENGINE) as llm:
        first = tokens(llm)
    llm = LLM(model_dir, **ENGINE)
    assert tokens(llm) == first
    workers = llm.engine.runner.workers.procs
    del llm
    assert all(not p.is_alive() for p in workers)
    llm = LLM(model_dir, **ENGINE)
    try:
        assert tokens(llm) == first
    finally:
        llm.close()


def test_a_second_engine_while_one_runs_is_refused_at_once(tiny_model_root):
    model_dir = make_tiny_model("llama_gqa", tiny_model_root)
    with LLM(model_dir, **ENGINE):
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="already runs a tensor-parallel engine"):
            LLM(model_dir, **ENGINE)
        assert time.monotonic() - began < 10
