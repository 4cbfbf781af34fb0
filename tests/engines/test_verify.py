"""``python -m engines verify``: each engine against ONNX Runtime through Polygraphy's Comparator.

Polygraphy's TrtRunner needs TensorRT and CUDA; here the engine side is the fake's runner (the plan
deserialized by FakeTensorRT, run by ONNX Runtime), or Polygraphy's own OnnxrtRunner on the graph
(a real ONNX Runtime vs ONNX Runtime comparison), through the same code path as on a device.
"""

import importlib.util
import json

import pytest

from engines import verify as verify_module
from engines.__main__ import main
from engines.errors import EngineConfigError
from engines.verify import TOLERANCE, verify_engines
from export.parity import ort_session
from runtime.artifact.manifest import load_manifest
from tests.engines.fakes import FakeTensorRT, FakeToolchain, fake_trt_runner
from tests.engines.test_build import build

no_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                                 reason="TensorRT is installed here: the missing-TensorRT path cannot run")


class WrongGraph(FakeToolchain):
    """Builds layer_01's engine from layer_00's graph: an engine that runs, but computes the wrong thing."""

    def compiler(self, plan, config, timing_cache, log=print):
        real = super().compiler(plan, config, timing_cache, log)
        compile_ = real.compile

        def compile(spec, onnx_path, profiles):
            if spec.name == "layer_01":
                onnx_path = onnx_path.with_name("layer_00.onnx")
            return compile_(spec, onnx_path, profiles)

        real.compile = compile
        return real


def ort_runner(plan, profile, name):
    """The engine side as Polygraphy's ONNX Runtime runner on the graph the (fake) plan names."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    return OnnxrtRunner(lambda: ort_session(json.loads(plan.read_bytes())["onnx"]), name=name)


@pytest.mark.parametrize("version,int_dtype", [("10.3.0", "INT64"), ("8.6.1", "INT32")])
def test_every_engine_and_profile_matches_onnxruntime(artifact_dir, tmp_path, version, int_dtype):
    build(artifact_dir, tmp_path, FakeToolchain(version))
    runners = []

    def runner(plan, profile, name):
        runners.append(fake_trt_runner(FakeTensorRT(version, int_dtype))(plan, profile, name))
        return runners[-1]

    checks = verify_engines(artifact_dir, tmp_path, runner=runner, progress=False)
    graphs = [g.name for g in load_manifest(artifact_dir).graphs]
    assert [(c.graph, c.profile) for c in checks] == [(g, p) for g in graphs for p in ("prefill", "decode")]
    assert all(c.passed for c in checks), [c.line() for c in checks if not c.passed]
    assert max(c.max_abs_diff for c in checks) < 1e-5  # the same graph on both sides
    # each engine ran once, at its profile's opt shapes (INT32 ids and mask on the 8.x flavour)
    for r, c in zip(runners, checks):
        assert r.shapes == [{n: tuple(s) for n, s in c.shapes.items()}]
        assert r.shapes[0] == {n: tuple(s.opt) for n, s in r.profile.shapes.items()}
    decode = next(c for c in checks if c.graph == "layer_00" and c.profile == "decode")
    assert decode.shapes["hidden_states"][1] == 1 and decode.line().startswith("[  ok] layer_00 decode: max |diff| ")


def test_ort_against_ort_is_a_real_comparison(artifact_dir, tmp_path):
    build(artifact_dir, tmp_path, WrongGraph())
    checks = verify_engines(artifact_dir, tmp_path, runner=ort_runner, progress=False)
    failed = sorted({c.graph for c in checks if not c.passed})
    assert failed == ["layer_01"], [c.line() for c in checks]
    assert all(c.max_abs_diff > TOLERANCE[0] for c in checks if c.graph == "layer_01")
    assert all(c.max_abs_diff < 1e-5 for c in checks if c.graph != "layer_01")


def test_cli_reports_each_engine_and_exits_1_on_a_difference(artifact_dir, tmp_path, capsys, monkeypatch):
    build(artifact_dir, tmp_path, WrongGraph("10.3.0"))
    monkeypatch.setattr(verify_module, "trt_runner", fake_trt_runner(FakeTensorRT("10.3.0")))
    code = main(["verify", str(artifact_dir), "--engine-dir", str(tmp_path), "-q"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0].startswith(f"verify engines of {artifact_dir} against ONNX Runtime through Polygraphy ")
    assert out[0].endswith("(TrtRunner vs OnnxrtRunner, compare_accuracy, atol 0.03 rtol 0.03)")
    assert "  [FAIL] layer_01 prefill: max |diff| " in "\n".join(out)
    assert out[-1] == "FAILED: layer_01 prefill, layer_01 decode"
    code = main(["verify", str(artifact_dir), "--engine-dir", str(tmp_path), "--graph", "head", "-q"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 4 and out[-1] == "PASSED"


def test_nothing_built_or_an_unknown_graph_is_a_user_error(artifact_dir, tmp_path, capsys):
    assert main(["verify", str(artifact_dir), "--engine-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    build(artifact_dir, tmp_path, FakeToolchain())
    with pytest.raises(EngineConfigError, match="no engine for layer_99 in .*; built: embed, layer_00"):
        verify_engines(artifact_dir, tmp_path, graphs=["layer_99"], runner=ort_runner)


@no_tensorrt
def test_without_tensorrt_the_cli_says_how_to_get_it(artifact_dir, tmp_path, capsys):
    build(artifact_dir, tmp_path, FakeToolchain())
    assert main(["verify", str(artifact_dir), "--engine-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TensorRT is not installed in this Python environment")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None,
                    reason="TensorRT is not installed here (it cannot be on these machines)")
def test_real_tensorrt_engines_match_onnxruntime(artifact_dir, tmp_path):
    """On a device: real engines through Polygraphy's TrtRunner, within the tolerance of ONNX Runtime."""
    from engines.build import build_engines
    from engines.config import EngineBuildConfig

    build_engines(artifact_dir, EngineBuildConfig(max_batch=4, max_seq=32, max_prompt=16), engine_dir=tmp_path,
                  progress=False, log=lambda *_: None)
    checks = verify_engines(artifact_dir, tmp_path, progress=False)
    assert checks and all(c.passed for c in checks), [c.line() for c in checks]
