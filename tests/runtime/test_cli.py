"""``python -m runtime``: the API's options, --json, --version, and exit 2 with one line on every
user error."""

import json
import re
import subprocess
import sys

import pytest

from runtime.__main__ import main
from runtime.policy import SkipPolicy
from runtime.version import __version__


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "error: max_new_tokens must be an int >= 1, got 0"),
    (["--top-p", "0", "--do-sample"], "error: top_p must be a number in (0, 1]"),
    (["--threads", "0"], "error: threads must be an int >= 1"),
    (["--seed", "-3"], "error: seed must be None or an int >= 0, got -3"),
    (["--max-layers", "3"], "error: --max-layers and --min-layers go together"),
    (["--max-layers", "3", "--min-layers", "4"], "error: min_layers (4) must be <= max_layers (3)"),
    (["--speedup", "2", "--max-layers", "3", "--min-layers", "2"], "error: pass --speedup or --max-layers"),
    (["--speedup", "2", "--decay", "power", "--exponent", "0"], "error: exponent must be a finite number > 0"),
    (["--max-new-tokens", "100"], "exceeds max_length 64 of this Generator (the model's max_position_embeddings is 64); lower max_new_tokens to at most"),
    (["--device", "tpu", "--backend", "torch"], "error: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--device", "tpu"], "error: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--spin", "--backend", "torch"], "error: --spin applies to --backend onnxruntime (its thread pools), not torch"),
    (["--no-spin", "--backend", "torch"], "error: --no-spin applies to --backend onnxruntime (its thread pools), not torch"),
    (["--huge-pages", "--backend", "torch"], "error: --huge-pages applies to --backend onnxruntime (the weights it packs), not torch"),
    (["--deterministic", "--backend", "torch"], "error: --deterministic applies to --backend onnxruntime, not torch"),
    (["--int4-kernel", "tinygemm"], "error: --int4-kernel tinygemm applies to --backend torch, not onnxruntime"),
    (["--int4-kernel", "onnxruntime", "--backend", "torch"],
     "error: --int4-kernel onnxruntime applies to --backend onnxruntime, not torch"),
    (["--compile-steps"], "error: --compile-steps compiles the torch backend's CUDA graph steps: pass it with "
                          "--backend torch --device cuda, not --backend onnxruntime"),
    (["--compile-steps", "--backend", "torch", "--device", "cpu"], "error: --compile-steps compiles the torch "
     "backend's CUDA graph steps: pass it with --backend torch --device cuda, not --backend torch --device cpu"),
    (["--max-batch", "0"], "error: max_batch must be an int >= 1, got 0"),
    (["--system", "Be brief."], "error: --system goes with --chat (a system message of a chat); add --chat"),
    (["--chat"], "error: --chat needs a chat template, and this artifact's tokenizer has none")])
def test_user_errors_exit_2_with_one_line(artifact_dir, capsys, argv, message):
    assert main([str(artifact_dir), "Hello", "--no-check-hashes", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_missing_artifact_and_bad_backend_via_the_command(tmp_path, artifact_dir):
    for argv, message in [([str(tmp_path / "none"), "x"], f"error: artifact directory {tmp_path / 'none'} does not exist"),
                          ([str(artifact_dir), "x", "--backend", "bogus"], "invalid choice: 'bogus'")]:
        done = subprocess.run([sys.executable, "-m", "runtime", *argv], capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_json_stop_ignore_eos_and_policy(artifact_dir, capsys):
    argv = [str(artifact_dir), "Hello, my name is", "Paris", "--json", "--max-new-tokens", "6", "--ignore-eos",
            "--max-layers", "4", "--min-layers", "2", "--warmup-layers", "1", "--backend", "torch", "--device", "cpu"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in rows] == ["Hello, my name is", "Paris"]
    assert all(len(r["token_ids"]) == 6 for r in rows)  # --ignore-eos: all of them
    assert rows[0]["policy"]["max_layers"] == 4 and rows[0]["policy"]["min_layers"] == 2
    assert rows[0]["stats"]["layers_per_step"][0] == 4 and isinstance(rows[0]["text"], str)
    stop = rows[0]["text"][:1]
    if stop:  # the first character of the text as a stop string: the row ends with the token that made it
        assert main(argv + ["--stop", stop]) == 0
        first = json.loads(capsys.readouterr().out.splitlines()[0])
        n = len(first["token_ids"])
        assert first["text"].startswith(stop) and rows[0]["text"].startswith(first["text"])
        assert first["token_ids"] == rows[0]["token_ids"][:n] and n < 6


def test_policy_shape_options(artifact_dir, capsys):
    argv = [str(artifact_dir), "Hello, my name is", "--json", "--max-new-tokens", "8", "--ignore-eos",
            "--speedup", "2", "--decay", "power", "--exponent", "3", "--prefill", "policy", "--no-check-hashes"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (row["policy"]["decay"], row["policy"]["exponent"], row["policy"]["prefill"]) == ("power", 3.0, "policy")


def test_speedup_with_warmup_layers(artifact_dir, capsys):
    """--speedup and --warmup-layers together: the speedup met with that many warm-up layers
    (runtime.cli.policy_fields, SkipPolicy.from_fields), as export build takes them."""
    argv = [str(artifact_dir), "Hello, my name is", "--json", "--max-new-tokens", "8", "--ignore-eos",
            "--speedup", "2", "--warmup-layers", "2", "--no-check-hashes"]
    assert main(argv) == 0
    policy = json.loads(capsys.readouterr().out.splitlines()[0])["policy"]
    assert SkipPolicy(**policy) == SkipPolicy.for_speedup(policy["num_layers"], 2, horizon=7, warmup_layers=2)


def test_lossless(artifact_dir, capsys):
    """--lossless: full depth's tokens at a 3x draft policy, and a summary line of the drafts."""
    base = [str(artifact_dir), "Hello, my name is", "--max-new-tokens", "12", "--ignore-eos", "--no-check-hashes"]
    assert main(base + ["--json"]) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[0])
    assert main(base + ["--json", "--speedup", "3", "--lossless"]) == 0
    ours = json.loads(capsys.readouterr().out.splitlines()[0])
    assert ours["token_ids"] == full["token_ids"]
    assert ours["stats"]["verify_passes"] > 0 and "acceptance_rate" in ours["stats"]
    assert main(base + ["--speedup", "3", "--lossless"]) == 0
    assert re.search(r"^lossless: \d+ of \d+ drafts kept \(\d+%\), [\d.]+ tokens per verify pass and row, "
                     r"\d+ passes$", capsys.readouterr().err, re.M)


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"python -m runtime {__version__} (skipdecode-edge)"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "(default: onnxruntime)" in flat and "{onnxruntime,torch,tensorrt}" in out and "--ignore-eos" in out
    assert "tokens to generate per prompt: 32 unless given, an interactive chat's answers 256" in flat


def test_cuda_device_without_cuda_onnxruntime(artifact_dir, capsys):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu offers CUDA here")
    assert main([str(artifact_dir), "Hello", "--device", "cuda:1", "--no-check-hashes"]) == 2
    err = capsys.readouterr().err
    assert "error: device='cuda:1' needs ONNX Runtime's CUDAExecutionProvider, which this onnxruntime" in err
    assert "install onnxruntime-gpu instead of onnxruntime (never both), or use device='cpu'" in err


def test_huge_pages_reach_the_backend_and_change_no_token(artifact_dir, capsys, monkeypatch):
    """--huge-pages moves the packed weights' memory, not their values: the same text, and a summary
    line with what the backend moved (a tiny model's weights fill no 2 MiB page: the count is the
    backend's, faked here)."""
    from runtime.platform import hugepages

    argv = [str(artifact_dir), "Hello, my name is", "--max-new-tokens", "6", "--ignore-eos", "--no-check-hashes"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    monkeypatch.setattr(hugepages, "snapshot", lambda: {})
    monkeypatch.setattr(hugepages, "collapse_new", lambda before: 123 << 20 if before == {} else 0)
    assert main(argv + ["--huge-pages"]) == 0
    huge = capsys.readouterr()
    assert huge.out == plain.out
    assert "huge pages: " not in plain.err
    assert "\nhuge pages: 123 MiB of packed weights on 2 MiB pages (--huge-pages;" in huge.err, huge.err


@pytest.mark.parametrize("flag, want", [([], None), (["--batch-invariant"], True), (["--no-batch-invariant"], False)])
def test_batch_invariant_reaches_load(artifact_dir, capsys, monkeypatch, flag, want):
    """--batch-invariant / --no-batch-invariant reach runtime.load (neither: its default, on for
    int8/int4 weights), and change no token of a float model's one prompt."""
    import runtime.__main__ as cli_main

    seen, real = [], cli_main.load

    def load(*args, **kwargs):
        seen.append(kwargs["batch_invariant"])
        return real(*args, **kwargs)

    monkeypatch.setattr(cli_main, "load", load)
    argv = [str(artifact_dir), "Hello, my name is", "--max-new-tokens", "6", "--ignore-eos", "--no-check-hashes"]
    assert main(argv + flag) == 0
    assert seen == [want] and "Hello, my name is" in capsys.readouterr().out


def test_compile_steps_reaches_the_torch_backend_on_cuda():
    """(No GPU needed: what the command line hands ``runtime.load``.)"""
    from argparse import Namespace

    from runtime.cli import backend_options

    args = Namespace(threads=None, spin="auto", backend="torch", device="cuda:0", compile_steps=True)
    assert backend_options(args) == {"device": "cuda:0", "compile_steps": True}
    assert backend_options(Namespace(**{**vars(args), "compile_steps": False})) == {"device": "cuda:0"}
