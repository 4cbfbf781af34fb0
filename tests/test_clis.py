"""Every command line: ``--version``, and a user error is one ``error:`` line and exit code 2."""

import importlib

import pytest

from runtime.version import __version__

CLIS = {  # module whose main() is the command -> the command's name
    "runtime.__main__": "python -m runtime", "export.__main__": "python -m export",
    "engines.__main__": "python -m engines", "tools.bench.cli": "python -m tools.bench",
    "tools.e2e.__main__": "python -m tools.e2e", "tools.evaluate.cli": "python -m tools.evaluate",
    "tools.finetune.cli": "python -m tools.finetune", "tools.trtexec.cli": "python -m tools.trtexec"}


@pytest.mark.parametrize("module", CLIS)
def test_version(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"{CLIS[module]} {__version__} (skipdecode-edge)"


@pytest.mark.parametrize("module, argv, message", [
    ("export.__main__", ["build", "--max-layers", "3"], "error: --max-layers and --min-layers go together"),
    ("export.__main__", ["verify", "/nonexistent/artifact"], "error: artifact directory /nonexistent/artifact does not exist"),
    ("engines.__main__", ["build", "/nonexistent/artifact", "--workspace", "lots"], "error: workspace 'lots' is not a size"),
    ("tools.bench.cli", ["--arch", "opt-7b"], "error: --arch 'opt-7b': choose from opt-125m"),
    ("tools.bench.cli", ["--arch", "opt-125m:batch=x"], "has a value that is not a number"),
    ("tools.e2e.__main__", ["split", "--data", "/nonexistent.csv"], "error: data file /nonexistent.csv does not exist"),
    ("tools.finetune.cli", ["--model", "/nonexistent", "--train", "/nonexistent.csv", "--out", "/tmp/x"], "error: "),
    ("tools.trtexec.cli", ["/nonexistent/artifact", "--graph", "embed"], "error: artifact directory /nonexistent/artifact does not exist")])
def test_user_error_is_one_line_and_exit_2(module, argv, message, capsys):
    assert importlib.import_module(module).main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("module, argv, message", [
    # the arguments before the toolchain: a wrong path is not reported as TensorRT missing
    ("engines.__main__", ["build", "/nonexistent/artifact"], "error: artifact directory /nonexistent/artifact does not exist"),
    ("tools.bench.memory", ["/nonexistent/artifact"], "error: artifact directory /nonexistent/artifact does not exist"),
    ("tools.bench.startup", ["/nonexistent/artifact"], "error: artifact directory /nonexistent/artifact does not exist")])
def test_arguments_are_checked_first(module, argv, message, capsys):
    assert importlib.import_module(module).main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


HELPS = [("runtime.__main__", []), ("export.__main__", ["build"]), ("export.__main__", ["verify"]),
         ("export.__main__", ["plan"]), ("engines.__main__", ["build"]), ("tools.bench.cli", []),
         ("tools.evaluate.cli", []), ("tools.finetune.cli", []), ("tools.trtexec.cli", []),
         ("tools.e2e.__main__", ["split"]), ("tools.e2e.__main__", ["init"]), ("tools.e2e.__main__", ["distill"]),
         ("tools.e2e.__main__", ["consensus"]), ("tools.bench.memory", []), ("tools.bench.startup", []), ("tools.bench.slots", []),
         ("tools.bench.gap", []), ("tools.bench.context", []), ("tools.bench.serving", []), ("tools.bench.gpu", []),
         ("tools.bench.structured", []), ("tools.bench.prefix", [])]


def _help(module, argv, monkeypatch) -> dict[str, str]:
    """Each option's help as ``--help`` prints it (defaults expanded), by its first flag."""
    import argparse

    shown = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: shown.append(self))
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main([*argv, "--help"])
    assert info.value.code == 0 and shown
    parser = shown[-1]
    formatter = parser._get_formatter()
    return {a.option_strings[0]: formatter._expand_help(a) if a.help else "" for a in parser._actions
            if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"}


@pytest.mark.parametrize("module, argv", HELPS)
def test_every_option_is_described_with_its_default_once(module, argv, monkeypatch):
    options = _help(module, argv, monkeypatch)
    for flag, text in options.items():
        assert text, f"{flag} has no help"
        assert "(default: None)" not in text and text.count("(default") <= 1, (flag, text)


def test_defaults_the_issue_named(monkeypatch):
    """--temperature, --do-sample, --backend, finetune's --epochs/--batch-size/--lr and the workspace."""
    run = _help("runtime.__main__", [], monkeypatch)
    assert "(default: 1)" in run["--temperature"] and "(default: onnxruntime)" in run["--backend"]
    assert "sample" in run["--do-sample"]
    tune = _help("tools.finetune.cli", [], monkeypatch)
    assert "(default: 10)" in tune["--epochs"] and "(default: 32)" in tune["--batch-size"]
    assert "(default: 0.0005)" in tune["--lr"]
    engines = _help("engines.__main__", ["build"], monkeypatch)
    assert "(default: 2GiB; pass 1GiB on 8 GB boards)" in engines["--workspace"]
    split = _help("tools.e2e.__main__", ["split"], monkeypatch)
    assert split["--data"] and "(default: 0.1)" in split["--val-fraction"]


def test_shipped_data_columns_and_outputs_outside_docs():
    """tools.evaluate and tools.finetune read data/e2e as it ships; trial runs leave docs/ alone."""
    from pathlib import Path

    from tools.evaluate.cli import _parser as evaluate_parser
    from tools.finetune.cli import _parser as finetune_parser
    from tools.finetune.data import read_pairs

    repo = Path(__file__).resolve().parents[1]
    evaluate = evaluate_parser().parse_args([])
    finetune = finetune_parser().parse_args(["--model", "M", "--train", "T", "--out", "O"])
    for args in (evaluate, finetune):
        pairs = read_pairs(repo / "data/e2e/devset.csv.gz", args.prompt_column, args.target_column)
        assert len(pairs) > 4000 and pairs[0].prompt.startswith("name[")
    assert not evaluate.out.startswith("docs/")
    from tools.bench.cli import _parser as bench_parser

    bench = bench_parser().parse_args([])
    assert bench.out is None and bench.plot is None  # WORK_DIR/benchmarks.md, WORK_DIR/benchmark_speedup.png


def test_progress_bars_only_on_a_terminal(monkeypatch):
    from runtime import cli

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert cli.progress(quiet=False) is True
    assert cli.progress(quiet=True) is False
    import os

    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # transformers' bars (children too)
    assert cli.progress(quiet=False) is False  # a child of a quiet command stays quiet


@pytest.mark.parametrize("module, argv, message", [
    ("tools.bench.serving", ["--artifact", "/nonexistent"], "error: --artifact /nonexistent: no manifest.json there"),
    ("tools.bench.gap", ["--artifact", "/nonexistent"], "error: --artifact /nonexistent: no manifest.json there"),
    ("tools.bench.slots", ["--artifact", "/nonexistent"], "error: --artifact /nonexistent: no manifest.json there")])
def test_bench_tools_refuse_a_missing_artifact_before_any_work(module, argv, message, capsys):
    with pytest.raises(SystemExit) as info:  # argparse's usage error: exit 2, no traceback
        importlib.import_module(module).main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_gpu_bench_without_cuda_is_a_user_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    assert importlib.import_module("tools.bench.gpu").main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: no CUDA device is visible") and err.count("\n") == 1


def test_one_name_per_concept_with_the_old_spellings_kept():
    """--quant-format (was --weights-format, one letter from optimum's --weight-format, which means
    --weights); --max-new-tokens everywhere, the old spellings hidden but working."""
    from export.__main__ import _parser as export_parser
    from tools.bench.cli import _parser as bench_parser

    build = export_parser().parse_args(["build", "--weights-format", "qdq", "--weight-format", "int4"])
    assert (build.quant_format, build.weights) == ("qdq", "int4")
    assert export_parser().parse_args(["build"]).quant_format == "matmulnbits"
    assert export_parser().parse_args(["plan", "--weight-format", "int8"]).weights == "int8"
    assert bench_parser().parse_args(["--new-tokens", "7"]).max_new_tokens == 7
    assert bench_parser().parse_args([]).max_new_tokens == 128


def _without(packages, code):
    """Run ``code`` in a child Python where importing any of ``packages`` fails, as on an install
    without their extra (the runtime-only `[cpu]` install of a Jetson)."""
    import subprocess
    import sys

    hide = "; ".join(f"sys.modules[{p!r}] = None" for p in packages)
    return subprocess.run([sys.executable, "-c", f"import sys; {hide}; {code}"], capture_output=True, text=True,
                          timeout=300)


def test_a_missing_extra_is_one_line_naming_it(artifact_dir):
    done = _without(["torch"], "from runtime.__main__ import main; "
                               f"sys.exit(main([{str(artifact_dir)!r}, 'x', '--backend', 'torch']))")
    assert done.returncode == 2 and done.stderr == (
        "error: this command needs the package torch, which is not installed: pip install "
        "'skipdecode-edge[export]'\n"), done.stderr
    done = _without(["torch", "onnx"], "from export.__main__ import main; "
                                       "sys.exit(main(['build', '--model', 'tiny-random', '-q']))")
    assert done.returncode == 2 and done.stderr.startswith("error: this command needs the package "), done.stderr
    # the plan is arithmetic: it needs neither
    done = _without(["torch", "onnx", "transformers"], "from export.__main__ import main; "
                                                       "sys.exit(main(['plan', 'opt-125m', '--tokens', '256']))")
    assert done.returncode == 0 and "opt-125m" in done.stdout, done.stderr


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_full_disk_under_stdout_is_one_line(artifact_dir):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "Hello", "--max-new-tokens", "2"],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr == (
        "error: cannot write standard output: No space left on device; free some space or write elsewhere\n")
