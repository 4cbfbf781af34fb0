"""tools.bench.staggered: requests started apart against one after another, on one Generator."""

from runtime.artifact.manifest import load_manifest
from tools.bench import staggered


def test_it_runs_both_ways_and_prints_their_ratio(artifact_dir, capsys):
    assert staggered.main(["--artifact", str(artifact_dir), "--requests", "3", "--new-tokens", "3", "5",
                           "--rounds", "1", "--load-option", "prefill_chunk=null"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("3 requests, speedups 1x, 2x, 3x, started 4 ms apart, best of 1 rounds, "
                      "{'prefill_chunk': None}")
    sequential, together, gain, calls = [c.strip() for c in out[-1].strip("|").split("|")]
    alone, shared = _calls(calls)
    assert 0 < shared <= alone  # (the tiny requests may each end before the next arrives)
    assert float(sequential) > 0 and float(together) > 0 and gain.endswith("x")
    s, t, g = float(sequential), float(together), float(gain[:-1])
    # the times print as whole ms: their ratio is the gain's within that rounding (10 / 13 ms read 0.77
    # for a printed 0.72 on this tiny model), and the gain's own rounding to 0.01
    rounding = 0.5 / (t - 0.5) * (1 + (s + 0.5) / (t - 0.5)) + 0.005
    assert abs(g - s / t) <= rounding


def test_a_bad_load_option_is_one_line(artifact_dir, capsys):
    assert staggered.main(["--artifact", str(artifact_dir), "--rounds", "1", "--load-option", "bogus=1"]) == 2
    assert "bogus is not among them" in capsys.readouterr().err


def _calls(cell: str) -> tuple[int, int]:
    """'A / B (Rx)': the layer calls one after another and together, R their ratio to 0.01."""
    alone, shared = (int(n) for n in cell.split(" (")[0].split(" / "))
    assert cell.endswith(f"({alone / shared:.2f}x)")
    return alone, shared


def test_layer_calls_count_each_layer_of_each_decode_step(artifact_dir, capsys):
    layers = load_manifest(artifact_dir, check_hashes=False).model.num_layers
    assert staggered.main(["--artifact", str(artifact_dir), "--requests", "3", "--new-tokens", "3", "5",
                           "--speedups", "1", "--rounds", "1"]) == 0
    alone, shared = _calls(capsys.readouterr().out.splitlines()[-1].strip("|").split("|")[3].strip())
    # 3 + 5 + 3 new tokens, the first of each from its prompt's pass: 2 + 4 + 2 decode steps of every layer
    assert alone == 8 * layers
    # together: at least the longest request's 4 steps, at most as many as alone
    assert 4 * layers <= shared <= alone
