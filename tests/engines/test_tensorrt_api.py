"""The fakes of tests/engines/fakes.py and the engines' own TensorRT calls against TensorRT's real
Python API, as the tensorrt-stubs package names it (tests/engines/tensorrt_api.py): a method the
fakes invent, or one TensorRT renames, fails here instead of passing every test against a fake that
agrees with the code. Names only, not signatures."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

from tests.engines import fakes
from tests.engines.tensorrt_api import module_names, parse_stub

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
API = json.loads((HERE / "tensorrt-10.13-api.json").read_text())
CLASSES = API["classes"]

# What the fakes hold for the tests (recordings, the graph they run), not TensorRT's API
FAKE_ONLY = {"trt", "onnx", "spec", "profiles", "tensors", "names", "session", "engine", "active", "shapes",
             "addresses", "int_dtype", "rename", "switches", "executions", "context_apis", "scratch", "bound",
             "severity"}
# TensorRT 8.x's names, which the fakes offer in that flavour and 10.x no longer has
TENSORRT_8_ONLY = {"IExecutionContext": {"device_memory"}}

# The engines' own calls on TensorRT objects, by the name the code gives each object
OBJECTS = {
    "engines/builder.py": {"self.builder": "Builder", "network": "INetworkDefinition", "layer": "ILayer",
                           "parser": "OnnxParser", "config": "IBuilderConfig", "seed": "IBuilderConfig",
                           "p": "IOptimizationProfile"},
    "engines/backend.py": {"engine": "ICudaEngine", "self.engine": "ICudaEngine", "self.context": "IExecutionContext",
                           "self._runtime": "Runtime"},
}


def _public(obj) -> set[str]:
    names = {n for n in dir(obj) if not n.startswith("_")} | set(getattr(obj, "__dict__", {}))
    return {n for n in names if not n.startswith("_")} - FAKE_ONLY


def _missing(names: set[str], cls: str) -> list[str]:
    allowed = set(CLASSES[cls]) | TENSORRT_8_ONLY.get(cls, set())
    return sorted(names - allowed)


@pytest.fixture
def fake_engine(tmp_path):
    trt = fakes.FakeTensorRT("10.13.0")
    plan = {"tensorrt": "10.13.0", "onnx": "x.onnx", "spec": {"name": "x", "file": "x.onnx", "inputs": [], "outputs": []},
            "profiles": []}
    return trt, fakes.FakeEngine(trt, json.dumps(plan).encode())


def test_the_fake_module_names_what_tensorrt_has():
    trt = fakes.FakeTensorRT("10.13.0")
    assert sorted(_public(trt) - set(API["module"])) == []
    assert _missing(set(vars(trt.TensorIOMode)), "TensorIOMode") == []
    assert _missing(set(vars(trt.ExecutionContextAllocationStrategy)), "ExecutionContextAllocationStrategy") == []
    assert _missing({"WARNING"}, "Logger") == []
    assert _missing(set(vars(trt.Runtime(None))), "Runtime") == []


def test_the_fake_engine_and_context_name_what_tensorrt_has(fake_engine):
    trt, engine = fake_engine
    assert _missing(_public(type(engine)) | _public(engine), "ICudaEngine") == []
    assert _missing(_public(fakes.FakeContext10), "IExecutionContext") == []


def _calls(path: Path, objects: dict[str, str]) -> set[tuple[str, str]]:
    """(class, member) of every ``OBJ.member`` in the file whose OBJ is one of ``objects``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            owner = ast.unparse(node.value)
            if owner in objects:
                found.add((objects[owner], node.attr))
    return found


def _module_chains(path: Path) -> set[tuple[str, str | None]]:
    """(name, member) of every ``trt.NAME`` and ``trt.NAME.MEMBER`` in the file."""
    found = set()
    for name, member in re.findall(r"\btrt\.(\w+)(?:\.(\w+))?", path.read_text(encoding="utf-8")):
        if not name.startswith("__"):
            found.add((name, member or None))
    return found


@pytest.mark.parametrize("relative", sorted(OBJECTS))
def test_the_engines_call_what_tensorrt_has(relative):
    calls = _calls(ROOT / relative, OBJECTS[relative])
    assert calls, "the map of the file's TensorRT objects matches nothing: update OBJECTS"
    assert sorted((c, m) for c, m in calls if m not in set(CLASSES[c]) | TENSORRT_8_ONLY.get(c, set())) == []


@pytest.mark.parametrize("relative", ["engines/backend.py", "engines/builder.py", "engines/versions.py"])
def test_the_engines_module_names_are_tensorrts(relative):
    chains = _module_chains(ROOT / relative)
    assert chains
    assert sorted(n for n, _ in chains if n not in API["module"]) == []
    assert sorted(f"{n}.{m}" for n, m in chains if m and n in CLASSES and m not in CLASSES[n]) == []


def test_the_stub_reader():
    text = ("class ILogger:\r\n    WARNING: int\r\n    def log(self, s): ...\r\nclass Logger(ILogger):\r\n"
            "    @property\r\n    def min_severity(self) -> int: ...\r\n    class Severity:\r\n        x = 1\r\n"
            "float32: DataType\r\n__all__ = ['Logger', 'float32']\r\n")
    assert parse_stub(text) == {"ILogger": ["WARNING", "log"], "Logger": ["Severity", "WARNING", "log", "min_severity"]}
    assert module_names(text) == ["Logger", "float32"]


def test_a_name_tensorrt_lacks_is_found():
    assert _missing({"execute_async_v3", "execute_async_v4"}, "IExecutionContext") == ["execute_async_v4"]
    assert inspect.isclass(fakes.FakeContext10)
