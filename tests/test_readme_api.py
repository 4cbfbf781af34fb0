"""README's Python example of the runtime API runs as printed, on a tiny 24-layer OPT exported where
it says artifacts/opt-1.3b (the example's SkipPolicy names 24 layers, as OPT-1.3B has)."""

import re
from pathlib import Path

from tests.conftest import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _api_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M)
    (example,) = [b for b in blocks if "runtime.load(" in b and "stepper()" in b]
    return example


def test_the_readme_python_example_runs_as_printed(tmp_path, monkeypatch, capsys):
    from export.build import BuildOptions, build

    # the example names artifacts/smollm2-135m-instruct (30 layers: its SkipPolicy(30, ...)), relative to
    # where it runs; a tiny model of as many layers stands in (the real one: docs, run by hand)
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln", num_hidden_layers=30)
    monkeypatch.chdir(tmp_path)
    build(BuildOptions(model=str(checkpoint), out="artifacts/smollm2-135m-instruct", check=False, progress=False),
          log=lambda *_: None)
    code = _api_example()
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102 - our own docs
    out = capsys.readouterr().out
    # it ran to its last line: the stats of generate's result and of the step loop's request
    assert out.count("GenerationStats(") == 2, out
