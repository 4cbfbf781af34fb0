"""The GPU-free TensorRT check: real exports against every listed parser version, hand-made graphs
that must fail, and the provenance of the operator data."""

import json
import re
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.build import BuildOptions, build
from export.trt_compat import (
    SupportData,
    TensorRTCompatibilityError,
    VersionSupport,
    changed_operators,
    check_artifact,
    check_graph,
    check_model,
    load_support,
)
from runtime.artifact.manifest import MANIFEST_NAME, load_manifest
from runtime.errors import SkipDecodeError

SUPPORT = load_support()
VERSIONS = list(SUPPORT.versions)

# Every error a real export gets, per version, and why. Kept exact (see test_known_failures_...), so
# the xfails below cannot hide a new incompatibility.
KNOWN_FAILURES = {
    "8.5": {("operator", "LayerNormalization")},
}
XFAIL = {
    "8.5": "no LayerNormalization importer before 8.6 (operators.md @ 6d0ab7be: N); JetPack 5 ships 8.5",
}


def _versions():
    for v in VERSIONS:
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[v])] if v in XFAIL else []
        yield pytest.param(v, marks=marks, id=f"trt{v}")


@pytest.fixture(params=["fp32", "fp16"])
def export_dir(request, artifact_dir):
    return artifact_dir if request.param == "fp32" else request.getfixturevalue("fp16_artifact_dir")


# -- real exports --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", list(_versions()))
def test_every_graph_of_an_export_parses(export_dir, version):
    report = check_artifact(export_dir, versions=[version])
    assert report.passed, "\n".join(report.lines())


@pytest.mark.parametrize("version", sorted(KNOWN_FAILURES))
def test_known_failures_are_exactly_the_explained_ones(export_dir, version):
    result = check_artifact(export_dir, versions=[version]).result(version)
    assert {(f.kind, f.op) for f in result.errors} == KNOWN_FAILURES[version]


def test_export_uses_the_operators_the_data_was_checked_for(artifact_dir):
    ops = set(check_artifact(artifact_dir).results[0].operators)
    # no ReduceSum: the layers' past is one block of rows, no longer a sum over pages; no Range,
    # Unsqueeze, And or LessOrEqual: the causal mask is a Trilu of a ConstantOfShape, the last T
    # columns and the probabilities' split are Slices (of a Neg'd length), shapes are constants
    # (runtime.graph_ops); Split: q/k/v are one MatMul (export.weights.fuse_sibling_matmuls)
    assert ops == {"Add", "Cast", "Concat", "Constant", "ConstantOfShape", "CumSum", "Gather", "Gemm", "Greater",
                   "Identity", "LayerNormalization", "MatMul", "Mul", "Neg", "Relu", "Reshape", "Shape",
                   "Slice", "Softmax", "Split", "Sub", "Transpose", "Trilu", "Where"}
    assert check_artifact(artifact_dir).results[0].opsets == [17]


def test_default_report_checks_the_jetson_parsers(artifact_dir):
    report = check_artifact(artifact_dir)
    assert report.passed and [r.version for r in report.results] == ["8.6", "10.3", "10.13", "10.16"]
    text = "\n".join(report.lines())
    assert "[  ok] TensorRT 10.13: 8 graphs, 24 operators at opset 17: all importable (onnx/onnx-tensorrt " \
           "docs/operators.md @ 4df1996807d8, nearest readable version)" in text
    assert "[  ok] TensorRT 10.16: 8 graphs, 24 operators at opset 17: all importable (onnx/onnx-tensorrt " \
           "docs/operators.md @ 6bde6596eca8)" in text


def test_report_names_versions_sources_and_documented_type_gaps(artifact_dir):
    report = check_artifact(artifact_dir, versions=["10.3", "11.0"])
    assert report.passed and [r.version for r in report.results] == ["10.3", "11.0"]
    text = "\n".join(report.lines())
    assert re.search(r"\[  ok\] TensorRT 10\.3: 8 graphs, 24 operators at opset 17: all importable", text)
    assert "onnx/onnx-tensorrt docs/operators.md @ 0137504e2b25, nearest readable version" in text
    assert "onnx/onnx-tensorrt docs/operators.md @ 2f3fa349247d" in text
    # positions are a CumSum in fp32 (operators.md lists only float types for CumSum): no type gap
    assert all(r.warnings == [] for r in report.results)
    assert check_artifact(artifact_dir, versions=["10.3"], strict_types=True).passed


def test_tensorrt_8_int64_inputs_are_reported_for_int32_bindings(artifact_dir):
    result = check_artifact(artifact_dir, versions=["8.6"]).result("8.6")
    int64 = {f.graph: f.detail for f in result.warnings if f.kind == "int64"}
    assert "input_ids, attention_mask" in int64["embed"] and "attention_mask" in int64["layer_00"]
    assert "head" not in int64


def test_an_incompatible_graph_in_an_artifact_fails_with_graph_operator_version_and_fix(artifact_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(artifact_dir, out)
    path = out / "layer_02.onnx"
    model = onnx.load(str(path))
    [relu] = [n for n in model.graph.node if n.op_type == "Relu"]
    i = list(model.graph.node).index(relu)
    seq = relu.output[0] + "_seq"
    zero = relu.output[0] + "_zero"
    model.graph.node.remove(relu)
    for k, node in enumerate([helper.make_node("Constant", [], [zero], value=numpy_helper.from_array(np.array(0))),
                              helper.make_node("SequenceConstruct", [relu.input[0]], [seq], name="/seq"),
                              helper.make_node("SequenceAt", [seq, zero], [relu.output[0]], name="/at")]):
        model.graph.node.insert(i + k, node)
    onnx.save(model, str(path))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["files"]["layer_02.onnx"]["bytes"] = path.stat().st_size
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    load_manifest(out, check_hashes=False)

    report = check_artifact(out, versions=["10.3"])
    assert not report.passed
    with pytest.raises(TensorRTCompatibilityError) as info:
        report.raise_for_errors()
    assert isinstance(info.value, SkipDecodeError)
    message = str(info.value)
    assert "TensorRT 10.3: layer_02: operator SequenceConstruct is marked unsupported (N)" in message
    assert "SequenceAt" in message and "fix: re-export without SequenceConstruct" in message
    assert {f.graph for f in info.value.findings} == {"layer_02"}


# -- hand-made graphs ----------------------------------------------------------------------------------


def _model(nodes, inputs, outputs, opset=17, initializers=(), domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _errors(findings_by_version):
    return {v: [f for f in fs if f.severity == "error"] for v, fs in findings_by_version.items()}


def test_unsupported_sequence_operator_fails_naming_operator_and_version():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    zero = numpy_helper.from_array(np.array(0, dtype=np.int64), "zero")
    model = _model([helper.make_node("SequenceConstruct", ["x", "x"], ["s"], name="/pack"),
                    helper.make_node("SequenceAt", ["s", "zero"], ["y"], name="/pick")],
                   [x], [y], initializers=[zero])
    errors = _errors(check_model(model, "seq_graph", versions="all"))
    for version in VERSIONS:
        assert {f.op for f in errors[version]} == {"SequenceConstruct", "SequenceAt"}
        for f in errors[version]:
            assert f.message.startswith(f"TensorRT {version}: seq_graph: operator {f.op} is marked unsupported (N)")
            assert f.fix
    error = TensorRTCompatibilityError(errors["10.3"])
    assert "TensorRT 10.3: seq_graph: operator SequenceConstruct" in str(error) and "fix:" in str(error)


def test_opset_past_the_documented_range_warns_unless_an_operator_changed(tmp_path):
    """No parser refuses a model for its opset (ModelImporter.cpp): past the documented maximum,
    an operator whose signature is unchanged since then is a warning; one that changed is an error."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    relu = helper.make_node("Relu", ["x"], ["y"])  # Relu-14: the same operator from opset 14 to 25
    for opset, past in [(17, set()), (18, {"8.5", "8.6"}), (21, {"8.5", "8.6", "10.3"}),
                        (24, {"8.5", "8.6", "10.3", "10.13"}),  # 10.13: the 10.12 file's 9-23 (see its opset)
                        (25, {"8.5", "8.6", "10.3", "10.13", "10.16", "11.0"})]:
        path = tmp_path / f"relu{opset}.onnx"
        onnx.save(_model([relu], [x], [y], opset=opset), str(path))
        results = check_graph(path, versions="all")
        assert not any(_errors(results).values()), opset
        warned = {v for v, fs in results.items() if any(f.kind == "opset" for f in fs)}
        assert warned == past, opset
        for v in past:
            [f] = [f for f in results[v] if f.kind == "opset"]
            assert f.message.startswith(f"TensorRT {v}: relu{opset}.onnx: opset {opset} is past the parser's "
                                        f"documented range")
            assert "the parser does not refuse an opset" in f.detail
            assert "python -m tools.trtexec" in f.fix
    # ReduceSum-13 takes axes as an input; opset 11's importer reads an attribute: a real break.
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 4])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 1])
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    reduce = helper.make_node("ReduceSum", ["data", "axes"], ["out"])
    model = _model([reduce], [data], [out], opset=13, initializers=[axes])
    assert changed_operators({"ReduceSum", "Relu"}, 11, 13) == ["ReduceSum"]
    assert changed_operators({"Relu", "Cast", "Reshape"}, 20, 21) == []  # types only
    assert changed_operators({"DequantizeLinear"}, 20, 21) == ["DequantizeLinear"]  # block_size
    support = load_support()
    narrow = SupportData({"9.9": VersionSupport("9.9", {**support.versions["8.6"].data,
                                                        "opset": {"min": None, "max": 11, "statement": "up to 11"}}),
                          **support.versions}, ("9.9",))
    [f] = [f for f in check_model(model, "reduce", versions="9.9", support=narrow)["9.9"] if f.kind == "opset"]
    assert f.severity == "error" and "ReduceSum changed after opset 11" in f.detail
    assert "--opset" in f.fix


def test_slice_axes_must_be_constant_before_tensorrt_10_3():
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 8])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, None])
    start = helper.make_tensor_value_info("start", TensorProto.INT64, [1])
    consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, dtype=np.int64)))
              for n, v in [("end", [8]), ("axes", [1]), ("one", 1), ("zero", [0])]]
    folded = _model([*consts, helper.make_node("Slice", ["data", "start", "end", "axes"], ["out"])],
                    [data, start], [out])
    assert not any(_errors(check_model(folded, versions="all")).values())
    computed = _model([*consts, helper.make_node("Unsqueeze", ["one", "zero"], ["axes_t"]),
                       helper.make_node("Slice", ["data", "start", "end", "axes_t"], ["out"], name="/slice")],
                      [data, start], [out])
    errors = _errors(check_model(computed, versions="all"))
    assert {v for v, fs in errors.items() if fs} == {"8.5", "8.6"}
    assert "Slice node '/slice': input 3 (axes) is computed" in errors["8.6"][0].detail


def test_layer_norm_extra_outputs_custom_domains_and_local_functions_are_errors():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    ln = _model([helper.make_node("LayerNormalization", ["x", "w"], ["y", "mean", "inv_std"], name="/ln")],
                [x], [y], initializers=[w])
    assert [f.detail for f in _errors(check_model(ln, versions=["10.3"]))["10.3"]] == [
        "LayerNormalization node '/ln' has 3 outputs: \"Only the first output `Y` is supported.\""]
    custom = _model([helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft")], [x], [y],
                    domains=["com.microsoft"])
    [f] = _errors(check_model(custom, versions=["11.0"]))["11.0"]
    assert f.kind == "domain" and "com.microsoft::FastGelu" in f.detail
    fn = helper.make_function("local", "MyRelu", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])],
                              [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("MyRelu", ["x"], ["y"], domain="local")], [x], [y], domains=["local"])
    model.functions.append(fn)
    errors = _errors(check_model(model, versions=["8.6", "10.3"]))
    assert [f.kind for f in errors["8.6"]] == ["function"] and errors["10.3"] == []


def test_graphs_are_read_without_their_external_weights(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], initializers=[w])
    onnx.save_model(model, str(tmp_path / "g.onnx"), save_as_external_data=True, location="g.onnx.data",
                    size_threshold=0)
    (tmp_path / "g.onnx.data").unlink()
    assert not any(_errors(check_graph(tmp_path / "g.onnx", versions="all")).values())


def test_unknown_version_is_refused():
    with pytest.raises(ValueError, match=r"no TensorRT operator data for 7\.2; known versions: 8\.5, 8\.6, 10\.3"):
        check_model(_model([], [], []), versions=["7.2"])


# -- the data ------------------------------------------------------------------------------------------


def test_every_version_names_its_source_and_opset_range():
    # the Jetson parsers: JetPack 6.0 (8.6), 6.1/6.2 (10.3), 7.0/7.1 (10.13), 7.2 (10.16); not 8.5
    # (JetPack 5's Python 3.8 is unsupported) nor 11.0 (no JetPack ships 11.0 to 11.4.0)
    assert SUPPORT.defaults == ("8.6", "10.3", "10.13", "10.16")
    assert [v for v, vs in SUPPORT.versions.items() if vs.data["default"]] == list(SUPPORT.defaults)
    jetson = [v for v, vs in SUPPORT.versions.items() if vs.data["platforms"][0].startswith("JetPack")]
    assert jetson == ["8.5", *SUPPORT.defaults]
    assert "no JetPack" in SUPPORT.versions["11.0"].data["platforms"][0]
    for version, vs in SUPPORT.versions.items():
        s = vs.source
        assert s["repository"] == "onnx/onnx-tensorrt" and s["path"] == "docs/operators.md", version
        assert re.fullmatch(r"[0-9a-f]{40}", s["commit"]) and s["ref"] and s["header"], version
        assert isinstance(s["exact_version"], bool) and s["chars"] > 10_000, version
        if not s["exact_version"]:
            assert len(s["caveat"]) > 50, f"{version}: a nearest-version source must say why"
        assert vs.data["opset"]["max"] >= 17 and vs.data["opset"]["statement"], version
        assert vs.data["int64"] in ("native", "cast_to_int32"), version
        assert len(vs.operators) > 150 and vs.operators["Relu"]["supported"], version
        assert not vs.operators["SequenceConstruct"]["supported"], version


def test_layer_normalization_arrives_in_8_6_with_opset_17():
    assert not SUPPORT.versions["8.5"].operators["LayerNormalization"]["supported"]
    for v in ("8.6", "10.3", "10.13", "10.16", "11.0"):
        assert SUPPORT.versions[v].operators["LayerNormalization"]["supported"]
    assert SUPPORT.versions["8.6"].opset_range == (None, 17)
    assert SUPPORT.versions["10.13"].opset_range == (9, 23)
    assert SUPPORT.versions["10.16"].opset_range == SUPPORT.versions["11.0"].opset_range == (9, 24)


def test_jetpack_7_parsers_are_their_own_tables():
    """10.13 (JetPack 7.0/7.1) and 10.16 (JetPack 7.2), as onnx-tensorrt's operators.md lists them."""
    v3, v13, v16, v11 = (SUPPORT.versions[v] for v in ("10.3", "10.13", "10.16", "11.0"))
    assert v16.source["commit"] == "6bde6596eca84abf9afe9b4d21c18c32800fd3ad" and v16.source["exact_version"]
    assert v16.source["header"].startswith("TensorRT 10.16 supports") and v16.source["chars"] == 18044
    # no 10.13-headed file is readable: the 10.12 one, whose rows the 10.14 file repeats (plus Attention)
    assert v13.source["commit"] == "4df1996807d844029e7aabefd54619af99f288f8" and not v13.source["exact_version"]
    assert v13.source["header"].startswith("TensorRT 10.12 supports") and v13.source["chars"] == 17245
    # LLM operators of 10.14 (Attention) and 10.15 (RotaryEmbedding, RMSNormalization, TensorScatter)
    for op in ("Attention", "RotaryEmbedding", "RMSNormalization", "TensorScatter"):
        assert op not in v3.operators and op not in v13.operators and v16.operators[op]["supported"], op
    assert "Swish" not in v16.operators and v11.operators["Swish"]["supported"]  # 11.0 GA
    assert {k: e for k, e in v11.operators.items() if k != "Swish"} == v16.operators
    # types 10.3 lacks: integer Pow (10.8/10.12), FP4 (10.8); the windows' types are first listed in 10.15
    assert "INT64" in v13.operators["Pow"]["types"] and "INT64" not in v3.operators["Pow"]["types"]
    dq = "DequantizeLinear"
    assert "FP4" in v13.operators[dq]["types"] and "FP4" not in v3.operators[dq]["types"]
    assert v13.operators["BlackmanWindow"] == {"supported": True} and not v3.operators["BlackmanWindow"]["supported"]
    assert v16.operators["BlackmanWindow"]["types"] == ["FP32", "FP16"]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    w = numpy_helper.from_array(np.ones(4, np.float32), "w")
    rms = _model([helper.make_node("RMSNormalization", ["x", "w"], ["y"], name="/rms")], [x], [y], opset=23,
                 initializers=[w])
    errors = _errors(check_model(rms, versions=["10.3", "10.13", "10.16"]))
    [f] = errors["10.13"]
    assert f.op == "RMSNormalization" and "is not in the parser's operator list in TensorRT 10.13" in f.detail
    assert "@ 4df1996807d8, nearest readable version" in f.detail and f.fix.startswith("use TensorRT 10.16 or newer")
    assert [f.op for f in errors["10.3"]] == ["RMSNormalization"] and errors["10.16"] == []
    # Squeeze with computed axes: an error on 10.3 (an initializer), a warning from 10.7 on (10.13, 10.16)
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 1])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])
    one = numpy_helper.from_array(np.array(1, dtype=np.int64), "one")
    zero = numpy_helper.from_array(np.array([0], dtype=np.int64), "zero")
    squeeze = _model([helper.make_node("Unsqueeze", ["one", "zero"], ["axes"]),
                      helper.make_node("Squeeze", ["data", "axes"], ["out"], name="/squeeze")],
                     [data], [out], initializers=[one, zero])
    results = check_model(squeeze, versions=["10.3", "10.13", "10.16"])
    assert [f.severity for f in results["10.3"] if f.op == "Squeeze"] == ["error"]
    for v in ("10.13", "10.16"):
        [f] = [f for f in results[v] if f.op == "Squeeze"]
        assert f.severity == "warning" and "must be resolvable to a constant" in f.detail, v


def test_opset_16_export_parses_on_tensorrt_8_5(checkpoint_dir, tmp_path):
    """JetPack 5 (TensorRT 8.5) has no LayerNormalization importer: --opset 16 decomposes it."""
    out = tmp_path / "opset16"
    manifest = build(BuildOptions(model=str(checkpoint_dir), out=str(out), opset=16, progress=False),
                     log=lambda *_: None)
    assert manifest.opset == 16 and manifest.checks["passed"]
    report = check_artifact(out, versions="all")
    assert report.passed, "\n".join(report.lines())
    assert "LayerNormalization" not in report.result("8.5").operators
