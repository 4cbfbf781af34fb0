"""Layering (issue 9 part 4): ``runtime`` stands alone. It imports nothing from ``export`` or
``engines`` (they import runtime, so the arrows point one way), finds the TensorRT backend through
an entry point, and imports without TensorRT. The ONNX Runtime path (issue 12 part 2) loads and
generates without torch or transformers, and ``import runtime`` alone imports no backend."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import runtime.backends as backends

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("export", "engines")
# Imports still to move, with where that is tracked. main's torch backend (the paged contract)
# already dropped this one: delete the entry once that is merged here; nothing else may be added.
def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of every module ``source`` (a module of ``package``) imports, at any depth
    (lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module)
    return names


def test_runtime_imports_neither_export_nor_engines():
    found = {}
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for name in imported_modules(path.read_text(), package):
            if name.split(".")[0] in FORBIDDEN:
                found[(rel, name)] = True
    assert ROOT.joinpath("runtime/backends/onnxruntime.py").is_file()  # the walk saw the backends
    assert not found, f"runtime must not import export or engines: {sorted(found)}"


def test_imported_modules_sees_lazy_and_relative_imports():
    source = "from ..manifest import Manifest\nfrom . import base\n\ndef f():\n    import export.build\n"
    assert imported_modules(source, "runtime.backends") == {"runtime.manifest", "runtime.backends",
                                                            "export.build"}


def test_import_runtime_needs_neither_tensorrt_nor_engines():
    code = ("import sys, runtime, runtime.backends, runtime.generator; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'engines', 'export')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_tensorrt_backend_comes_from_the_entry_point():
    from engines.backend import TensorRTBackend

    assert backends.entry_point_backend("tensorrt") is TensorRTBackend


def test_missing_entry_point_says_how_to_fix(monkeypatch, artifact_dir):
    import runtime

    from importlib import metadata

    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    with pytest.raises(backends.BackendNotInstalledError) as info:
        runtime.load(artifact_dir, backend="trt")
    assert str(info.value) == (
        "backend 'tensorrt' is provided by the engines package of skipdecode-edge through the "
        "'skipdecode_edge.backends' entry point, and none is registered in this environment; "
        "reinstall with pip install -e .")


LIGHT_CHECK = """
import sys
import runtime
assert 'onnxruntime' not in sys.modules, 'import runtime imported onnxruntime before a load'
gen = runtime.load(sys.argv[1], threads=1, **eval(sys.argv[2]))
result = gen.generate(["Hello, my name is", "Paris"], 4, speedup=2)
gen.close()
assert len(result.texts) == 2 and all(len(ids) == 4 for ids in result.token_ids), result
heavy = sorted(m for m in ('torch', 'transformers', 'onnx') if m in sys.modules)
assert not heavy, f'the ONNX Runtime path imported {heavy}'
assert 'onnxruntime' in sys.modules  # the check above saw a real load
"""


@pytest.mark.parametrize("options", ["{}", "{'device': 'cpu'}"], ids=["plain", "iobinding"])
def test_onnxruntime_path_imports_neither_torch_nor_transformers(artifact_dir, options):
    # a fresh interpreter: this test process has imported torch and transformers long ago. The
    # IOBinding backend (device=...) is what onnxruntime-gpu gets by default: on a Jetson with
    # only the runtime installed, it must not need the onnx package either.
    done = subprocess.run([sys.executable, "-c", LIGHT_CHECK, str(artifact_dir), options], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_cli_imports_neither_torch_nor_transformers(artifact_dir):
    code = ("import sys, runtime.__main__ as m; rc = m.main([sys.argv[1], 'Paris', '--max-new-tokens', '2', "
            "'--threads', '1']); heavy = sorted(x for x in ('torch', 'transformers') if x in sys.modules); "
            "assert rc == 0 and not heavy, (rc, heavy)")
    done = subprocess.run([sys.executable, "-c", code, str(artifact_dir)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
