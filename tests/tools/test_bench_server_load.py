"""python -m tools.bench.server_load on a tiny artifact: the server starts, every level runs, one table."""

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tools.bench.server_load import main  # noqa: E402

pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")


def test_bench_serve_prints_a_row_per_level(artifact_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.csv"  # short: the tiny model has 64 positions
    prompts.write_text("mr\nHello\nParis is\n")
    assert main([str(artifact_dir), "--clients", "1", "2", "--speedups", "1", "2", "--max-tokens", "3",
                 "--requests-per-client", "1", "--min-requests", "2", "--warmup", "1",
                 "--prompts", str(prompts)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("| replicas | speedup |"):].strip().splitlines()
    assert len(table) == 2 + 4
    for line, (speedup, clients) in zip(table[2:], [("1x", 1), ("1x", 2), ("2x", 1), ("2x", 2)]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == ["1 (no Ray)", speedup, str(clients), "2"]
        assert 0 < float(cells[4]) <= 3  # tokens per request
