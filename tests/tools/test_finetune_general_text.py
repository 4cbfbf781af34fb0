"""tools.finetune.general_text: general text from what the machine holds, prose only, held-out
texts left out, the same rows for the same seed."""

import csv

from tools.finetune import general_text as gt


def _read(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_paragraphs_are_prose_only():
    long = "word " * 80
    text = "\n\n".join([long, "# A heading " + long, "| a | table |\n|---|---|", "```\ncode\n```",
                        "    indented " + long, ">>> 1 + 1\n2", "A session:\n  >>> 1 + 1\n  2 " + long, "too short",
                        "python -m tools.x " + long,
                        "two\nlines " + long])
    assert gt.paragraphs(text) == [" ".join(long.split()), "two lines " + " ".join(long.split())]


def test_rows_from_three_sources_cut_and_reproducible(tmp_path, capsys):
    out = tmp_path / "data" / "general.csv"
    assert gt.main(["--out", str(out), "--max-chars", "400", "--e2e-rows", "10"]) == 0
    printed = capsys.readouterr().out
    rows = _read(out)
    counts = {s: sum(r["source"] == s for r in rows) for s in ("pydoc", "docs", "e2e")}
    assert printed == f"{out}: {len(rows)} rows ({counts['pydoc']} pydoc, {counts['docs']} docs, 10 e2e)\n"
    assert counts["pydoc"] > 100 and counts["docs"] > 50
    assert all(len(r["prompt"]) + len(r["target"]) <= 400 and r["target"].startswith(" ") for r in rows)
    assert all(gt.PROMPT_CHARS <= len(r["prompt"]) < len(r["prompt"]) + len(r["target"]) for r in rows)
    # the texts docs/quality.md holds out are not trained on
    held_out = (gt.REPO / "data" / "prose" / "essays.txt").read_text().split("\n\n")[0][:60]
    assert not any(held_out in r["prompt"] + r["target"] for r in rows)
    again = tmp_path / "again.csv"
    assert gt.main(["--out", str(again), "--max-chars", "400", "--e2e-rows", "10"]) == 0
    assert again.read_bytes() == out.read_bytes()
    assert [p.name for p in out.parent.iterdir()] == ["general.csv"]  # no partial file left


def test_bad_options_are_one_line(tmp_path, capsys):
    assert gt.main(["--out", str(tmp_path / "x.csv"), "--max-chars", "50"]) == 2
    assert capsys.readouterr().err == "error: --max-chars must exceed the prompt's 100 characters, got 50\n"
    assert not (tmp_path / "x.csv").exists()


def test_stdlib_docstrings_are_a_fourth_source(tmp_path, capsys):
    out = tmp_path / "general.csv"
    assert gt.main(["--out", str(out), "--e2e-rows", "0", "--stdlib"]) == 0
    rows = _read(out)
    counts = {s: sum(r["source"] == s for r in rows) for s in ("pydoc", "docs", "e2e", "stdlib")}
    assert capsys.readouterr().out.endswith(f"{counts['pydoc']} pydoc, {counts['docs']} docs, 0 e2e, "
                                            f"{counts['stdlib']} stdlib)\n")
    assert counts["stdlib"] > 300
    stdlib = " ".join(r["prompt"] + r["target"] for r in rows if r["source"] == "stdlib")
    import inspect
    import logging  # a docstring of the standard library's own, read from its source
    assert gt.paragraphs(inspect.cleandoc(logging.Logger.__doc__))[0][:80] in stdlib
    assert ">>>" not in stdlib
