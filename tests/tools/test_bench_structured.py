"""``python -m tools.bench.structured``: free and JSON-constrained decode steps side by side, its table."""

import pytest

from tools.bench import structured

pytest.importorskip("llguidance")


def test_the_table_compares_free_and_constrained_steps(artifact_dir, capsys):
    argv = [str(artifact_dir), "--batch", "1", "2", "--max-new-tokens", "4", "--rounds", "1", "--threads", "1"]
    assert structured.main(argv) == 0
    out = capsys.readouterr().out
    assert f"Command: `python -m tools.bench.structured {' '.join(argv)}`; vocabulary 512;" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert [r[0].strip() for r in rows] == ["1", "2"]
    for r in rows:
        free, constrained = float(r[1]), float(r[2])
        assert free > 0 and constrained > 0
        # the cost as printed, within what the rounding of the two printed step times (0.005 ms) allows
        low, high = ((constrained - 0.005) / (free + 0.005) - 1) * 100, ((constrained + 0.005) / (free - 0.005) - 1) * 100
        assert low - 0.05 <= float(r[3].strip().rstrip("%")) <= high + 0.05
