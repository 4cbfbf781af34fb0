"""python -m tools.bench.soak on a tiny artifact, at a small size: a mixed load through the openai
client gets no 5xx, every greedy answer equals the same request alone, bad requests get a 4xx,
abandoned streams free their rows, and SIGTERM lets the running streams finish."""

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tools.bench.soak import main  # noqa: E402

pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")


def test_a_small_mixed_load_is_clean(artifact_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.csv"  # short: the tiny model has 64 positions
    prompts.write_text("mr\nHello\nParis is\nThe quick brown fox\n")
    assert main([str(artifact_dir), "--rounds", "2", "--requests", "40", "--clients", "6", "--max-batch", "4",
                 "--threads", "1", "--max-tokens", "8", "--prefix-words", "12", "--prompts", str(prompts),
                 "--sigterm-streams", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == "40" and cells[4] == "0" and cells[5] == "0"  # requests, 5xx, other failures
        bad, of = cells[3].split(" of ")
        assert bad == of  # every bad request got a 4xx
        same, greedy = cells[6].split(" of ")
        assert same == greedy and int(greedy) > 0
    assert "SIGTERM with 3 streams running: 3 finished, the server exited 0" in out
