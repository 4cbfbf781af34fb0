"""``python -m tools.bench.lossless``: lossless rows against full depth and the lossy policy, its table."""

from tools.bench import lossless


def test_lossless_rows_say_they_are_full_depths_tokens(artifact_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nThe quick brown fox\n\nParis\n")
    out_file = tmp_path / "table.md"
    argv = [str(artifact_dir), "--prompts", str(prompts), "--batch", "1", "3", "--speedups", "2", "--rounds", "1",
            "--max-new-tokens", "10", "--threads", "1", "--out", str(out_file)]
    assert lossless.main(argv) == 0
    out = capsys.readouterr().out
    assert f"Command: `python -m tools.bench.lossless {' '.join(argv)}`" in out
    assert "3 prompts" in out and out_file.read_text() in out  # the same table, written
    rows = {(cells[1].strip(), cells[2].strip()): cells for cells in
            (line.split("|") for line in out.splitlines() if line.startswith("| ") and "row" not in line)}
    assert set(rows) == {(b, r) for b in ("1", "3") for r in ("full depth", "plain 2x", "lossless 2x")}
    for batch in ("1", "3"):
        assert rows[(batch, "full depth")][4].strip() == "1.00x"
        assert rows[(batch, "lossless 2x")][7].strip() == "yes"  # full depth's tokens, every prompt
        assert rows[(batch, "lossless 2x")][5].strip().endswith("%")  # drafts kept
        assert rows[(batch, "plain 2x")][5].strip() == "-"


def test_the_default_prompts_are_the_e2e_development_split():
    prompts = lossless.load_prompts(None, "mr", 3)
    assert len(prompts) == 3 and all(p.startswith("name[") for p in prompts)
