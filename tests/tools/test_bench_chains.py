"""python -m tools.bench.chains: both loads of an artifact side by side, in processes of their own."""

import pytest

from export.build import BuildOptions, build
from runtime.backends import ort_capi
from tests.export.test_fused import GQA_SHAPES
from tests.families import save_tiny_checkpoint
from tools.bench import chains


@pytest.mark.skipif(not ort_capi.available(), reason="this onnxruntime ships no C library")
def test_both_loads_give_the_same_tokens(tmp_path, capsys):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "smollm2", **GQA_SHAPES["smollm2"])  # fused graphs
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    out = tmp_path / "chains.md"
    assert chains.main([str(tmp_path / "art"), "--rounds", "1", "--max-new-tokens", "6", "--prompt", "4",
                        "--speedups", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0] == ("| row | per layer (ms/token) | chains (ms/token) | chains vs per layer | "
                                     "same tokens |")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert list(rows) == ["full depth", "2x", "load (s)", "peak RSS (MB)", "RSS after (MB)"]
    assert rows["full depth"].endswith("| yes |") and rows["2x"].endswith("| yes |")
    assert out.read_text() == table


def test_bad_arguments_stop_before_any_process(capsys):
    assert chains.main(["nowhere", "--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rounds must be >= 1, got 0"
