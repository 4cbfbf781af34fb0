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
                 "--prompts", str(prompts), "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("| replicas | speedup |"):].strip().splitlines()
    assert len(table) == 2 + 4
    for line, (speedup, clients) in zip(table[2:], [("1x", 1), ("1x", 2), ("2x", 1), ("2x", 2)]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:4] == ["1 (no Ray)", speedup, str(clients), "2"]
        assert cells[4] == "3.0"  # tokens per request: max_tokens, EOS ignored
        tokens_per_s, requests_per_s = float(cells[5]), float(cells[6])
        # tokens/s is 3 x requests/s, up to their printed rounding (0.5 and 0.05)
        assert tokens_per_s > 0 and abs(tokens_per_s - 3 * requests_per_s) <= 0.5 + 3 * 0.05 + 1e-9
        for cell in cells[7:]:  # p50 / p90 of TTFT, per output token, latency: positive, in order
            p50, p90 = (float(x) for x in cell.split(" / "))
            assert 0 <= p50 <= p90, cell


def test_whole_answers_give_latency_and_throughput_but_no_token_times(artifact_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("mr\nHello\nParis is\n")
    assert main([str(artifact_dir), "--clients", "2", "--speedups", "2", "--max-tokens", "3", "--whole",
                 "--requests-per-client", "1", "--min-requests", "2", "--warmup", "1",
                 "--prompts", str(prompts), "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    (line,) = out[out.index("| replicas | speedup |"):].strip().splitlines()[2:]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:5] == ["1 (no Ray)", "2x", "2", "2", "3.0"] and float(cells[5]) > 0
    assert cells[7:9] == ["-", "-"]  # a whole answer's first token is not seen
    p50, p90 = (float(x) for x in cells[9].split(" / "))
    assert 0 < p50 <= p90
