"""python -m tools.bench.startup: import -> load -> first token, timed in fresh processes."""

from __future__ import annotations

import json

import pytest

from tools.bench import startup


def test_startup_times_every_phase_in_a_fresh_process(artifact_dir, capsys):
    assert startup.main([str(artifact_dir), "--runs", "2", "--warmup", "0", "--threads", "1", "--prompt", "Paris"]) == 0
    out = capsys.readouterr().out
    assert "imported onnxruntime, tokenizers, numpy;" in out  # neither torch nor transformers
    for name in ("`import runtime`", "`runtime.load`", "first token", "**import to first token**"):
        assert f"| {name} |" in out
    record = startup.run_once(str(artifact_dir), "Paris", {"threads": 1})
    assert record["total_s"] == pytest.approx(record["import_s"] + record["load_s"] + record["first_token_s"])
    assert record["process_s"] > record["total_s"] > 0 and "torch" not in record["modules"]


def test_runs_alternate_between_checkouts_and_print_json(artifact_dir, capsys):
    root = str(startup.REPO)
    assert startup.main([str(artifact_dir), "--runs", "1", "--warmup", "0", "--json",
                         "--checkout", root, "--checkout", root + "/"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2 and {r["checkout"] for r in records} == {root}


def test_a_directory_that_is_no_artifact_is_refused_before_any_run(tmp_path, capsys):
    assert startup.main([str(tmp_path), "--runs", "1", "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "manifest.json" in err and err.count("\n") == 1, err
