"""tools.bench.staggered: requests started apart against one after another, on one Generator."""

from tools.bench import staggered


def test_it_runs_both_ways_and_prints_their_ratio(artifact_dir, capsys):
    assert staggered.main(["--artifact", str(artifact_dir), "--requests", "3", "--new-tokens", "3", "5",
                           "--rounds", "1", "--load-option", "prefill_chunk=null"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("3 requests, speedups 1x, 2x, 3x, started 4 ms apart, best of 1 rounds, "
                      "{'prefill_chunk': None}")
    sequential, together, gain = [c.strip() for c in out[-1].strip("|").split("|")]
    assert float(sequential) > 0 and float(together) > 0 and gain.endswith("x")
    s, t, g = float(sequential), float(together), float(gain[:-1])
    # the times print as whole ms: their ratio is the gain's within that rounding (10 / 13 ms read 0.77
    # for a printed 0.72 on this tiny model), and the gain's own rounding to 0.01
    rounding = 0.5 / (t - 0.5) * (1 + (s + 0.5) / (t - 0.5)) + 0.005
    assert abs(g - s / t) <= rounding


def test_a_bad_load_option_is_one_line(artifact_dir, capsys):
    assert staggered.main(["--artifact", str(artifact_dir), "--rounds", "1", "--load-option", "bogus=1"]) == 2
    assert "bogus is not among them" in capsys.readouterr().err
