"""tools.bench.serving's data and streams, tools.bench.slots' table, tools.bench.gap's statistics,
tools.bench.checkouts' keys and options; one short run of slots and gap on a tiny artifact each.

Fast: the pure parts take no model; the two runs are a few seconds on the tiny export.
"""

from __future__ import annotations

import csv
import gzip
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tools.bench import checkouts, gap, serving, slots
from tools.bench.server_load import load_prompts

ROWS = [("name[A], food[French]", "A serves French food."), ("name[B]", "B is a pub."),
        ("name[A], food[French]", "French food at A.")]


def _write(path, rows=ROWS, compress=False):
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mr", "ref"])
        w.writerows(rows)
    return path


def _words(text):  # a stand-in tokenizer: one token per word, plus BOS
    return {"input_ids": [0] + [1] * len(text.split())}


# -- the E2E data: plain and gzip CSV, the shipped default -----------------------------------------


@pytest.mark.parametrize("name, compress", [("val.csv", False), ("dev.csv.gz", True)])
def test_plain_and_gzip_csv_read_alike(tmp_path, name, compress):
    path = _write(tmp_path / name, compress=compress)
    assert serving.read_e2e(path) == ROWS
    assert load_prompts(str(path), "mr") == ["name[A], food[French]", "name[B]"]  # unique, in order


def test_the_default_data_is_the_shipped_dev_split(tmp_path, monkeypatch):
    assert serving.DEFAULT_DATA == "data/e2e/devset.csv.gz"
    monkeypatch.chdir(tmp_path)  # not the repository: found next to the module all the same
    path = serving.data_path(None)
    assert path == serving.REPO / "data/e2e/devset.csv.gz" and path.is_file()
    rows = serving.read_e2e(path)
    assert len(rows) == 4672 and rows[0][0].startswith("name[")
    assert serving.data_path(str(tmp_path / "mine.csv")) == tmp_path / "mine.csv"  # a given path is kept


def test_a_missing_data_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        serving.main(["--data", str(tmp_path / "val.csv")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err


# -- the wide stream ---------------------------------------------------------------------------------


def test_wide_lengths_are_seeded_log_uniform_in_16_256():
    n = serving.wide_lengths(4000, seed=0)
    assert n == serving.wide_lengths(4000, seed=0) and n != serving.wide_lengths(4000, seed=1)
    assert min(n) >= 16 and max(n) <= 256 and all(isinstance(x, int) for x in n)
    assert min(n) == 16 and max(n) == 256  # both ends are reached
    # log-uniform: each octave (16-31, 32-63, 64-127, 128-255) holds about a quarter of the draws
    octaves = np.histogram(np.log2(n), bins=[4, 5, 6, 7, 8.01])[0] / len(n)
    assert np.all(np.abs(octaves - 0.25) < 0.04), octaves
    assert 56 <= np.median(n) <= 72  # near the geometric mean, 64; a uniform draw's median is 136


def test_wide_stream_keeps_the_e2e_arrivals_prompts_and_speedups(tmp_path):
    data = _write(tmp_path / "d.csv.gz", compress=True)
    e2e = serving.make_stream(data, _words, 40, 4.0, [1, 2, 5], 64, seed=3)
    wide = serving.make_stream(data, _words, 40, 4.0, [1, 2, 5], 256, seed=3, lengths="wide")
    assert [(a.at, a.prompt, a.speedup) for a in e2e] == [(a.at, a.prompt, a.speedup) for a in wide]
    assert [a.new_tokens for a in wide] == serving.wide_lengths(40, 3)
    assert {a.new_tokens for a in e2e} == {6}  # every reference: BOS + 4 words, +1 for EOS
    capped = serving.make_stream(data, _words, 40, 4.0, [1], 32, seed=3, lengths="wide")
    assert max(a.new_tokens for a in capped) == 32
    assert serving.needed_length(_words, wide) == max(len(a.prompt.split()) + 1 for a in wide) + max(
        a.new_tokens for a in wide)
    with pytest.raises(ValueError):
        serving.make_stream(data, _words, 4, 4.0, [1], 64, seed=0, lengths="narrow")


def test_serving_table_has_both_ratios():
    med = {"engine": {"throughput": 120.0, "p50": 1.0, "p90": 2.0},
           "static": {"throughput": 80.0, "p50": 2.0, "p90": 4.0},
           "serial": {"throughput": 40.0, "p50": 5.0, "p90": 9.0}}
    lines = serving.render(med)
    assert lines[0] == "| mode | throughput tok/s | latency p50 s | latency p90 s | vs static | vs serial |"
    assert lines[2] == "| engine | 120.0 | 1.00 | 2.00 | 1.50x | 3.00x |"
    assert lines[4] == "| serial | 40.0 | 5.00 | 9.00 | 0.50x | 1.00x |"


# -- slots: the table --------------------------------------------------------------------------------


def test_slots_table_cells_and_long_short_ratio():
    ms = {(1, 32): 20.0, (1, 500): 25.0, (8, 32): 30.0, (8, 500): 50.0, (32, 32): 40.0, (32, 500): 100.0}
    lines = slots.render_table(ms, [1, 8, 32], [32, 500])
    assert lines[0] == ("| max_batch | prompt 32: ms/token (vs max_batch=1) | prompt 500: ms/token (vs max_batch=1) "
                        "| long/short (500/32) |")
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| 1 | 20.00 (1.00x) | 25.00 (1.00x) | 1.25x |"
    assert lines[3] == "| 8 | 30.00 (1.50x) | 50.00 (2.00x) | 1.67x |"
    assert lines[4] == "| 32 | 40.00 (2.00x) | 100.00 (4.00x) | 2.50x |"
    missing = slots.render_table({(1, 32): 20.0}, [1, 8], [32, 500])
    assert missing[3] == "| 8 | – | – | – |"


def test_slots_comparison_of_checkouts():
    ms = {"/b": {(1, 32): 20.0, (8, 32): 40.0}, ".": {(1, 32): 20.0, (8, 32): 20.0}}
    lines = slots.render_comparison(ms, ["/b", "."], [1, 8], [32])
    assert lines[0] == "| max_batch | prompt | /b ms | . ms | . / /b |"
    assert lines[3] == "| 8 | 32 | 40.00 | 20.00 | 0.50x |"


# -- gap: statistics from timestamps --------------------------------------------------------------------


def test_gap_statistics_from_timestamps():
    times = [0.0, 0.05, 0.10, 0.15, 0.65, 0.70, 0.75]  # a 500 ms stall before the 5th token
    s = gap.gap_stats(times, submitted=0.16, second_first=0.64)
    assert s.median_ms == pytest.approx(50) and s.longest_ms == pytest.approx(500)
    assert s.ratio == pytest.approx(10) and s.longest_at == 5
    assert s.join_gap_ms == pytest.approx(500) and s.ttft_ms == pytest.approx(480)
    chunked = [0.0, 0.05, 0.10, 0.15, 0.25, 0.35, 0.42, 0.50, 0.90, 0.95]  # the stall comes later
    c = gap.gap_stats(chunked, submitted=0.12, second_first=0.41)
    assert c.join_gap_ms == pytest.approx(100) and c.longest_ms == pytest.approx(400) and c.longest_at == 9
    bare = gap.gap_stats([1.0, 1.1, 1.3])
    assert bare.longest_at == 3 and math.isnan(bare.join_gap_ms) and math.isnan(bare.ttft_ms)
    with pytest.raises(ValueError):
        gap.gap_stats([1.0])


def test_gap_medians_across_rounds_and_table():
    rounds = [gap.GapStats(50, 500, 10, 21, 500, 480), gap.GapStats(60, 900, 15, 22, 900, 880),
              gap.GapStats(40, 700, 17.5, 21, 700, 690)]
    m = gap.combine(rounds)
    assert (m.median_ms, m.longest_ms, m.ratio, m.longest_at, m.ttft_ms) == (50, 700, 15, 21, 690)
    lines = gap.render({"/b": m})
    assert lines[2] == "| /b | 50.00 | 700.0 | 15.0x | 21 | 700.0 | 690.0 |"


# -- checkouts: keys and options ----------------------------------------------------------------------


def test_load_options_parse_json_values():
    assert checkouts.parse_options(["prefill_chunk=64", "prefill_chunk2=null", "name=x", "a=[1, 2]"]) == {
        "prefill_chunk": 64, "prefill_chunk2": None, "name": "x", "a": [1, 2]}
    with pytest.raises(ValueError):
        checkouts.parse_options(["prefill_chunk"])


def test_checkout_key_follows_head_and_the_export_and_runtime_sources(tmp_path):
    assert checkouts.checkout_key(tmp_path).startswith("path-")  # not a git work tree
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("n\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    clean = checkouts.checkout_key(tmp_path)
    assert len(clean) == 12 and "dirty" not in clean
    (tmp_path / "notes.md").write_text("changed\n")  # outside export/ and runtime/: same artifact
    assert checkouts.checkout_key(tmp_path) == clean
    (tmp_path / "runtime" / "a.py").write_text("x = 2\n")
    dirty = checkouts.checkout_key(tmp_path)
    assert dirty.startswith(clean + "-dirty-")
    (tmp_path / "runtime" / "new.py").write_text("y = 1\n")  # an untracked file counts too
    assert checkouts.checkout_key(tmp_path) not in (clean, dirty)


def test_artifact_is_built_once_per_checkout_key_with_that_checkouts_export(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, cwd, env, **kwargs):
        calls.append((cmd, cwd, env["PYTHONPATH"].split(":")[0]))
        Path(cmd[cmd.index("--out") + 1]).mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(checkouts.subprocess, "run", fake_run)
    tree = tmp_path / "before"
    tree.mkdir()
    a = checkouts.artifact_for(tree, "opt-125m", tmp_path / "work", key="abc", log=lambda *_: None)
    assert a == (tmp_path / "work" / "checkouts" / "opt-125m-abc" / "artifact").resolve() and a.is_dir()
    cmd, cwd, path = calls[0]
    assert cmd[1:7] == ["-m", "export", "build", "--model", "opt-125m", "--random-weights"]
    assert cwd == tree.resolve() and path == str(tree.resolve())  # that checkout's export and runtime
    assert checkouts.artifact_for(tree, "opt-125m", tmp_path / "work", key="abc", log=lambda *_: None) == a
    assert len(calls) == 1  # reused
    checkouts.artifact_for(tree, "opt-125m", tmp_path / "work", key="def", log=lambda *_: None)
    assert len(calls) == 2  # another key (a new HEAD or a change in export/ or runtime/): its own build


# -- one short run each, on the tiny export ------------------------------------------------------------

tiny_pre_ln = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")


@tiny_pre_ln
def test_slots_runs_every_configuration(artifact_dir, tmp_path, capsys):
    assert slots.main(["--artifact", str(artifact_dir), "--max-batch", "1", "4", "--prompts", "8",
                       "--new-tokens", "6", "--warmup-tokens", "2", "--threads", "1", "--rounds", "1",
                       "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("| max_batch |"):].strip().splitlines()
    assert len(table) == 4 and table[2].startswith("| 1 | ") and "(1.00x)" in table[2]
    assert (tmp_path / "slots.json").is_file()


@tiny_pre_ln
def test_gap_runs_and_reports_the_join(artifact_dir, tmp_path, capsys):
    assert gap.main(["--artifact", str(artifact_dir), "--short-prompt", "4", "--new-tokens", "16",
                     "--join-after", "4", "--long-prompt", "24", "--join-new-tokens", "3", "--threads", "1",
                     "--rounds", "1", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = out[out.index("| checkout |"):].strip().splitlines()[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # tokens read from the worker's pipe can arrive together on a busy machine: a median gap of 0.00
    assert cells[0] == "." and float(cells[2]) > 0 and float(cells[2]) >= float(cells[1]) >= 0
