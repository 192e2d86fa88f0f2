"""bench/results/README.md is the index that `python -m bench.results_index` generates from the
results files, and every results file carries its command, commit, machine and date."""
from __future__ import annotations

import difflib
import json

import pytest

from bench.results_index import COMMAND, INDEX, RESULTS, entries, render


def test_every_results_file_says_how_where_and_when_it_was_made():
    rows = entries()                      # raises, naming each file that lacks a field
    listed = {name for row in rows for name in row["files"]}
    assert listed == {p.name for p in RESULTS.iterdir() if p.name != "README.md"}


def test_committed_index_is_the_generated_one():
    committed = INDEX.read_text(encoding="utf-8")
    generated = render(entries())
    if committed != generated:
        diff = "\n".join(list(difflib.unified_diff(
            committed.splitlines(), generated.splitlines(), "committed", "generated",
            lineterm=""))[:20])
        pytest.fail(f"bench/results/README.md is stale: run `{COMMAND}`\n{diff}")


def test_a_file_without_its_fields_is_named(tmp_path):
    (tmp_path / "ok.json").write_text(json.dumps(
        {"command": "python -m bench.x", "commit": "abc1234", "machine": "cpu",
         "date": "2026-11-28", "result": {}}))
    (tmp_path / "ok.png").write_bytes(b"")
    (tmp_path / "bare.json").write_text(json.dumps({"tok_s": 1.0}))
    (tmp_path / "orphan.png").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        entries(tmp_path)
    assert "bare.json: no command, commit, machine, date" in str(e.value)
    assert "orphan.png" in str(e.value) and "ok.json" not in str(e.value)
