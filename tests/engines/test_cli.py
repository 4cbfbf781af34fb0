"""``python -m engines build`` where TensorRT is missing (as on every machine of this project)."""

import importlib.util
import subprocess
import sys

import pytest

from engines.__main__ import main

no_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                                 reason="TensorRT is installed here: the missing-TensorRT path cannot run")


@no_tensorrt
def test_missing_tensorrt_explains_and_exits_2(artifact_dir, tmp_path, capsys):
    code = main(["build", str(artifact_dir), "--max-batch", "8", "--max-seq", "32", "--workspace", "1GiB",
                 "--engine-dir", str(tmp_path / "engines"), "-q"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: TensorRT is not installed in this Python environment (No module named 'tensorrt').")
    assert "TensorRT comes with JetPack" in err and "pip install tensorrt" in err
    assert "backend='onnxruntime'" in err
    assert not (tmp_path / "engines").exists()  # nothing written


@no_tensorrt
def test_module_entry_point(artifact_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "engines", "build", str(artifact_dir), "--max-seq", "32",
                           "--engine-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "TensorRT is not installed" in done.stderr


def test_bad_workspace_exits_2(artifact_dir, capsys):
    assert main(["build", str(artifact_dir), "--workspace", "lots"]) == 2
    assert "error: workspace 'lots' is not a size" in capsys.readouterr().err


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["build"])
    assert info.value.code == 2
