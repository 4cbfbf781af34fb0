"""``python -m runtime``'s output: the texts on stdout, the figures on stderr, --stream printing the
text once, a reader that leaves early, the sampling options' warning and the old option spellings."""

import json
import subprocess
import sys

import pytest

from runtime.__main__ import main


def _json_text(artifact_dir, capsys, *argv) -> dict:
    assert main([str(artifact_dir), "Hello, my name is", "--json", "--no-check-hashes", *argv]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[0])


def test_stream_prints_the_text_once_and_the_figures_on_stderr(artifact_dir, capsys):
    expected = _json_text(artifact_dir, capsys, "--max-new-tokens", "6", "--ignore-eos")["text"]
    assert main([str(artifact_dir), "Hello, my name is", "--stream", "--max-new-tokens", "6", "--ignore-eos",
                 "--no-check-hashes"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    assert "policy: SkipPolicy(" in err and "x fewer layers over the horizon)" in err and "x fewer than full depth" in err
    assert "run speedup" not in err  # a layer count is never printed as a speed (only --compare measures one)


def test_compare_prints_a_wall_clock_run_speedup(artifact_dir, capsys):
    assert main([str(artifact_dir), "Hello, my name is", "--speedup", "2", "--compare", "--max-new-tokens", "8",
                 "--ignore-eos", "--no-check-hashes"]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("run speedup "))
    ratio = float(line.split()[2].rstrip("x"))
    assert ratio > 0 and "ms/token" in line and "end to end" in line and line.endswith("(--compare)")
    assert "8 -> 8 tokens" in line


def test_the_figures_are_what_the_call_waited(artifact_dir, capsys):
    stats = _json_text(artifact_dir, capsys, "--max-new-tokens", "6", "--ignore-eos", "--speedup", "2")["stats"]
    assert 0 < stats["first_token_seconds"] <= stats["seconds"]
    assert stats["prefill_seconds"] + stats["decode_seconds"] <= stats["seconds"]
    # (the JSON's ms are rounded to 3 decimals)
    assert stats["decode_ms_per_token"] == pytest.approx(stats["decode_seconds"] * 1e3 / 5, rel=1e-3, abs=5e-4)
    assert stats["layer_reduction"] > 1 and "theoretical_speedup" not in stats


def test_plain_output_is_one_line_per_prompt(artifact_dir, capsys):
    assert main([str(artifact_dir), "Hello, my name is", "Paris", "--max-new-tokens", "4", "--no-check-hashes"]) == 0
    out, err = capsys.readouterr()
    assert [line.split(" -> ")[0] for line in out.splitlines()] == ["'Hello, my name is'", "'Paris'"]
    assert "layers per step" in err and "layers per step" not in out
    # a request's own rate (what each waits per token), the batch's sum apart
    (time,) = [line for line in err.splitlines() if line.startswith("time: ")]
    ms = float(time.split("decode ")[1].split(" ms/token")[0])
    per_request = float(time.split("ms/token (")[1].split(" tokens/s per request")[0])
    in_all = float(time.split("the batch of 2: ")[1].split(" tokens/s in all")[0])
    # ms/token is printed to 0.01 ms: on this tiny model (~0.3 ms) that rounding alone moves 1e3 / ms by ~2%
    assert 1e3 / (ms + 0.005) - 0.05 <= per_request <= 1e3 / (ms - 0.005) + 0.05
    assert in_all == pytest.approx(2 * per_request, rel=0.05)


def test_stream_takes_one_prompt_and_not_json(artifact_dir, capsys):
    assert main([str(artifact_dir), "Hello", "Paris", "--stream", "--no-check-hashes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --stream prints one prompt's text as it comes, got 2 prompts") and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        main([str(artifact_dir), "Hello", "--stream", "--json"])
    assert info.value.code == 2 and "argument --json: not allowed with argument --stream" in capsys.readouterr().err


def test_sampling_options_without_do_sample_warn(artifact_dir, capsys):
    greedy = _json_text(artifact_dir, capsys, "--max-new-tokens", "5")
    warned = _json_text(artifact_dir, capsys, "--max-new-tokens", "5", "--temperature", "0.7", "--top-k", "3")
    assert warned["token_ids"] == greedy["token_ids"]  # greedy all the same, as the warning says
    assert main([str(artifact_dir), "Hello", "--json", "--temperature", "0.7", "--top-k", "3",
                 "--max-new-tokens", "2", "--no-check-hashes"]) == 0
    assert capsys.readouterr().err == ("warning: --temperature 0.7, --top-k 3 only apply with --do-sample; "
                                       "decoding greedily (pass --do-sample, or leave them out)\n")
    assert main([str(artifact_dir), "Hello", "--json", "--do-sample", "--temperature", "0.7", "--seed", "0",
                 "--max-new-tokens", "2", "--no-check-hashes"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("alias", ["--new-tokens", "--max-new", "--max-tokens"])
def test_old_spellings_of_max_new_tokens(artifact_dir, capsys, alias):
    row = _json_text(artifact_dir, capsys, alias, "3", "--ignore-eos")
    assert len(row["token_ids"]) == 3
    with pytest.raises(SystemExit):
        main(["--help"])
    assert alias + " " not in capsys.readouterr().out  # kept working, not advertised


def test_a_reader_that_leaves_early_ends_it_quietly(artifact_dir):
    """`python -m runtime ART p | head -1`: the pipe is closed before the texts are written."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime", str(artifact_dir), "Hello", "Paris",
                             "--max-new-tokens", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_fp16_warning_is_the_commands_own(fp16_artifact_dir):
    done = subprocess.run([sys.executable, "-m", "runtime", str(fp16_artifact_dir), "Hello", "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("warning: this float16 artifact runs on ONNX Runtime's CPU provider"), done.stderr
    assert "<frozen" not in done.stderr and "UserWarning" not in done.stderr
