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


def test_default_max_seq_fits_the_model_and_an_explicit_one_past_it_is_refused(artifact_dir, monkeypatch, capsys):
    """engines build's default --max-seq (1024) is capped at the model's positions (the demo model
    has 256), so `engines build DIR` works on every artifact; an explicit one past them is an error."""
    import engines.build
    from runtime.artifact.manifest import load_manifest

    limit = load_manifest(artifact_dir, check_hashes=False).model.max_position_embeddings
    assert limit < 1024
    built = []

    class Stop(Exception):
        pass

    def build_engines(directory, config, **_):
        built.append(config)
        raise Stop  # before TensorRT

    monkeypatch.setattr(engines.build, "build_engines", build_engines)
    with pytest.raises(Stop):
        main(["build", str(artifact_dir), "-q"])
    assert built[0].max_seq == limit and built[0].prompt_limit == limit

    assert main(["build", str(artifact_dir), "--max-seq", str(limit + 1), "-q"]) == 2
    assert capsys.readouterr().err.startswith(f"error: max_seq {limit + 1} exceeds max_position_embeddings {limit}")
