"""``python -m tools.bench.prefix``: time to first token with and without prompt reuse, its table."""

from tools.bench import prefix


def test_later_questions_take_the_system_prompt_from_the_cache(artifact_dir, capsys):
    argv = [str(artifact_dir), "--system-tokens", "34", "--questions", "3", "--max-new-tokens", "2", "--threads", "1"]
    assert prefix.main(argv) == 0
    out = capsys.readouterr().out
    assert f"Command: `python -m tools.bench.prefix {' '.join(argv)}`" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line[:4] in ("| 1 ", "| 2 ", "| 3 ")]
    cached = [int(r[2]) for r in rows]
    assert cached[0] == 0 and cached[1] == cached[2] == 32  # the system prompt's whole page, from the 2nd on
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows) and "median" in out
