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
