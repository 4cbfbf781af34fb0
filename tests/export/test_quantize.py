"""Weight-only quantization at export (export.quantize): graphs, parity, manifest, CLI, runtime."""

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from transformers import OPTForCausalLM

import runtime
from export.__main__ import main as export_main
from export.build import BuildOptions, build
from export.parity import QUANT_TOLERANCES, check_graph
from export.quantize import QuantConfig, dequantized_weights
from export.trt_compat import check_model
from runtime.artifact.manifest import MANIFEST_NAME, load_manifest
from runtime.errors import ArtifactError, InvalidArgumentError
from runtime.models.base import graph_module
from runtime.models.opt import SkipOPT
from tests.conftest import PROMPTS, first_logits, save_tiny_checkpoint

quiet = dict(log=lambda *_: None)
BLOCK = 16  # divides the tiny model's hidden 32, ffn 64 and embedding width 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("quant-ckpt"), "pre_ln")


def _build(ckpt, out, **options):
    return build(BuildOptions(model=str(ckpt), out=str(out), progress=False, block_size=BLOCK, **options), **quiet)


@pytest.fixture(scope="module")
def int4_dir(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "model"
    _build(ckpt, out, weights="int4")
    return out


def _ops(path):
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def test_int4_artifact_quantizes_layers_and_head_and_records_it(int4_dir):
    manifest = load_manifest(int4_dir)
    assert manifest.weights == {"embed": "float", "layers": "int4", "head": "int4", "block_size": BLOCK,
                                "format": "matmulnbits", "accuracy_level": 0}
    assert manifest.quantized and manifest.graph_weights("layer_03") == "int4"
    assert manifest.weights_label == "int4 layers, int4 head (block 16, matmulnbits), float32 embed"
    assert "MatMulNBits" not in _ops(int4_dir / "embed.onnx")  # one row per token: not worth it
    layer = onnx.load(str(int4_dir / "layer_00.onnx"))
    nbits = [n for n in layer.graph.node if n.op_type == "MatMulNBits"]
    # q+k+v (one MatMul: export.weights.fuse_sibling_matmuls), out, fc1, fc2; the attention's
    # MatMuls on activations stay
    assert len(nbits) == 4
    assert all(next(a.i for a in n.attribute if a.name == "bits") == 4 for n in nbits)
    assert "MatMulNBits" in _ops(int4_dir / "head.onnx")
    checks = {g["graph"]: g for g in manifest.checks["graphs"]}
    assert checks["head"]["weights"] == "int4" and checks["head"]["rel_tolerance"] == QUANT_TOLERANCES["int4"]
    assert 0 < checks["layer_00"]["weight_error"] <= QUANT_TOLERANCES["int4"] and checks["layer_00"]["rel_error"] > 0
    assert checks["embed"]["weights"] == "float" and checks["embed"]["max_abs_diff"] < 1e-5
    fp32_bytes = 4 * sum(t.dims[0] * t.dims[1] for t in onnx.load(str(int4_dir / "embed.onnx")).graph.initializer
                         if len(t.dims) == 2)
    assert (int4_dir / "layer_00.onnx").stat().st_size < fp32_bytes  # packed, not float


def test_a_quantized_head_multiplies_the_hidden_states_as_they_come(int4_dir):
    """No flatten for the tied Gemm, and no Reshape back that copied the logits: MatMulNBits reads
    (batch, sequence, hidden) and writes the graph's logits (export.weights.unflatten_head); the
    logits are those of the same head with the reshapes left in, bit for bit."""
    from export.weights import unflatten_head

    head = onnx.load(str(int4_dir / "head.onnx"))
    assert "Reshape" not in {n.op_type for n in head.graph.node}
    last = head.graph.node[-1]
    assert last.op_type == "MatMulNBits" and last.output[0] == "logits"
    assert not unflatten_head(head)  # nothing left to do: the pattern is gone

    # the same graph with the flatten and the Reshape back put in front of and after it
    from onnx import helper, numpy_helper

    flat = onnx.ModelProto.FromString(head.SerializeToString())
    g, mm = flat.graph, flat.graph.node[-1]
    k = next(a.i for a in mm.attribute if a.name == "K")
    g.initializer.extend([numpy_helper.from_array(np.array([-1, k], np.int64), "to2d")])
    g.node.insert(len(g.node) - 1, helper.make_node("Reshape", [mm.input[0], "to2d"], ["flat"]))
    shape_of = [helper.make_node("Shape", [mm.input[0]], ["lead"], start=0, end=-1),
                helper.make_node("Constant", [], ["vocab"], value=numpy_helper.from_array(np.array([-1], np.int64))),
                helper.make_node("Concat", ["lead", "vocab"], ["to3d"], axis=0)]
    g.node.extend([*shape_of, helper.make_node("Reshape", ["flat_logits", "to3d"], ["logits"])])
    mm.input[0], mm.output[0] = "flat", "flat_logits"
    x = np.random.default_rng(0).standard_normal((2, 3, k)).astype(np.float32)
    with_reshapes = _run_graph(flat, int4_dir, x)
    assert unflatten_head(flat) and "Reshape" not in {n.op_type for n in flat.graph.node}
    assert np.array_equal(_run_graph(flat, int4_dir, x), with_reshapes)
    assert np.array_equal(_run_graph(head, int4_dir, x), with_reshapes)


def _run_graph(proto, directory, x):
    import onnxruntime as ort

    path = directory / "_probe.onnx"  # beside the artifact: its weights file is found relative to it
    onnx.save_model(proto, str(path))
    try:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"hidden_states": x})[0]
    finally:
        path.unlink()


def test_ort_runtime_generates_from_a_quantized_artifact_close_to_float(int4_dir, ckpt, tmp_path):
    float_dir = tmp_path / "fp32"
    _build(ckpt, float_dir)
    with runtime.load(int4_dir, threads=1) as gen, runtime.load(float_dir, threads=1) as ref:
        got = first_logits(gen, PROMPTS, ignore_eos=True)  # (B, vocab) of the prompt pass
        want = first_logits(ref, PROMPTS, ignore_eos=True)
        skipped = gen.generate(PROMPTS, 8, speedup=2, ignore_eos=True)
    assert [len(t) for t in skipped.token_ids] == [8, 8, 8]
    assert skipped.stats.layer_reduction > 1.5
    # Six int4 layers and the head, end to end: the logits move, by far less than their size.
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-3 < rel < 0.5, rel


@pytest.mark.parametrize("weights,fmt", [("int4", "matmulnbits"), ("int8", "matmulnbits"), ("int4", "qdq")])
def test_quantized_graph_equals_reference_with_its_dequantized_weights(ckpt, tmp_path, weights, fmt):
    """The tight check: all the difference from PyTorch is the weights' rounding."""
    out = tmp_path / "q"
    _build(ckpt, out, weights=weights, weights_format=fmt, check=False)
    hf = OPTForCausalLM.from_pretrained(ckpt).eval()
    for name in ("layer_02", "head"):
        proto = onnx.load(str(out / f"{name}.onnx"))
        levels = {a.i for n in proto.graph.node if n.op_type == "MatMulNBits"
                  for a in n.attribute if a.name == "accuracy_level"}
        # float activations (level 1) by default: all the difference is the weights' rounding
        assert levels == (set() if fmt == "qdq" else {1})
        weights_used = dequantized_weights(proto)
        assert weights_used, f"{name} has no quantized MatMul"
        model = SkipOPT(copy.deepcopy(hf))
        module = graph_module(model, name)
        state = module.state_dict()
        for key, w in weights_used.items():  # "fc1.weight.T" (K, N) -> fc1.weight (N, K)
            target = key.removesuffix(".T")
            assert target in state, (target, list(state))
            assert not np.allclose(state[target].numpy(), w.T)  # rounding did change it
            state[target] = torch.from_numpy(np.ascontiguousarray(w.T))
        module.load_state_dict(state)
        manifest = load_manifest(out, check_hashes=False)
        # float tolerances: atol 1e-4, rtol 1e-4
        result = check_graph(model, manifest.graph(name), out, "float32", page_size=manifest.page_size)
        assert result.passed, result.line()


def test_quantized_parity_fails_a_graph_with_the_wrong_weights(int4_dir, ckpt):
    manifest = load_manifest(int4_dir, check_hashes=False)
    ref = SkipOPT(OPTForCausalLM.from_pretrained(ckpt).eval())
    assert check_graph(ref, manifest.graph("layer_01"), int4_dir, "float32", "int4",
                       page_size=manifest.page_size).passed
    swapped = copy.copy(manifest.graph("layer_01"))
    swapped.file = manifest.graph("layer_04").file  # another layer's weights under layer_01's name
    result = check_graph(ref, swapped, int4_dir, "float32", "int4", page_size=manifest.page_size)
    assert not result.passed and result.weight_error > 3 * QUANT_TOLERANCES["int4"]


def test_head_only_quantization_keeps_float_layers(ckpt, tmp_path):
    out = tmp_path / "head4"
    manifest = _build(ckpt, out, head_weights="int4")
    assert manifest.weights["layers"] == "float" and manifest.weights["head"] == "int4"
    assert "MatMulNBits" not in _ops(out / "layer_00.onnx")
    assert "MatMulNBits" in _ops(out / "head.onnx")
    layers = [g for g in manifest.checks["graphs"] if g["graph"].startswith("layer_")]
    assert all(g["weights"] == "float" and g["max_abs_diff"] < 1e-4 for g in layers)


def test_float_manifests_have_no_weights_field_and_old_ones_mean_float(ckpt, artifact_dir):
    raw = json.loads((artifact_dir / MANIFEST_NAME).read_text())
    assert "weights" not in raw
    manifest = load_manifest(artifact_dir)
    assert not manifest.quantized and manifest.graph_weights("head") == "float"
    assert manifest.weights_label == "float32"


def test_manifest_with_an_unknown_weights_format_is_refused(int4_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(int4_dir, bad)
    raw = json.loads((bad / MANIFEST_NAME).read_text())
    raw["weights"]["layers"] = "int3"
    (bad / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"weights \{'layers': 'int3'\} are not among float, int8, int4"):
        load_manifest(bad)


def test_cli_weights_block_size_and_errors(ckpt, tmp_path, capsys):
    out = tmp_path / "cli8"
    assert export_main(["build", "--model", str(ckpt), "--out", str(out), "-q", "--weights", "int8",
                        "--block-size", "16"]) == 0
    assert load_manifest(out).weights["layers"] == "int8"
    # float activations: every MatMulNBits at accuracy level 1, and the manifest says so
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "acc1"), "-q", "--weights", "int4",
                        "--block-size", "16", "--accuracy-level", "1"]) == 0
    assert load_manifest(tmp_path / "acc1").weights["accuracy_level"] == 1
    levels = {a.i for n in onnx.load(str(tmp_path / "acc1" / "layer_00.onnx")).graph.node
              for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {1}
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "x"), "--weights", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    # block 64 does not divide hidden 32: refused before any graph is written
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "y"), "-q",
                        "--weights", "int4", "--block-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "block_size 64 does not divide the model's hidden size 32 and embedding width 32" in err
    assert "pass --block-size 32 (or a smaller power of two >= 16)" in err  # the sizes' own fit
    assert not (tmp_path / "y").exists()
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "z"), "-q",
                        "--weights", "int8", "--weights-format", "qdq"]) == 2
    assert "qdq weights format is int4 only" in capsys.readouterr().err


@pytest.mark.parametrize("fields,match", [
    (dict(weights="int2"), "weights must be one of float, int8, int4"),
    (dict(weights="int4", block_size=24), "power of two >= 16"),
    (dict(weights="int4", format="gptq"), "weights format must be one of"),
])
def test_quant_config_is_validated(fields, match):
    with pytest.raises(InvalidArgumentError, match=match):
        QuantConfig(**fields)


def test_tensorrt_check_of_quantized_graphs(int4_dir, ckpt, tmp_path):
    """MatMulNBits: no TensorRT parses it (a contrib op). QDQ int4 at opset 21: 10.13, 10.16 and 11.0 by
    their documents."""
    nbits = onnx.load(str(int4_dir / "layer_00.onnx"), load_external_data=False)
    for version, findings in check_model(nbits, "layer_00", versions="all").items():
        errors = [f for f in findings if f.severity == "error" and f.op == "MatMulNBits"]
        assert errors and "--quant-format qdq" in errors[0].fix, version
    out = tmp_path / "qdq"
    _build(ckpt, out, weights="int4", weights_format="qdq", check=False)
    qdq = onnx.load(str(out / "layer_00.onnx"), load_external_data=False)
    assert {n.op_type for n in qdq.graph.node} >= {"DequantizeLinear", "MatMul"}
    assert "MatMulNBits" not in {n.op_type for n in qdq.graph.node}
    dq = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear"]
    assert all(len(n.input) == 2 for n in dq)  # symmetric: no zero point (TensorRT wants zeros)
    results = check_model(qdq, versions="all")
    errors = {v: [f for f in fs if f.severity == "error"] for v, fs in results.items()}
    assert errors["11.0"] == errors["10.16"] == errors["10.13"] == errors["10.3"] == []
    assert not [f for v in ("10.13", "10.16", "11.0") for f in results[v] if f.kind == "opset"]  # 21 is documented
    # 10.3 documents opsets 9-20 but its parser reads the blocked DequantizeLinear: confirm on the device
    [warning] = [f for f in results["10.3"] if f.kind == "opset"]
    assert "opset 21 is past the parser's documented range" in warning.detail
    assert "(DequantizeLinear) as this version's importer reads them" in warning.detail
    assert "python -m tools.trtexec" in warning.fix
    assert {f.kind for f in errors["8.6"]} == {"opset", "type"}  # and no INT4 at all
    assert any("this parser has no INT4" in f.detail and "TensorRT 10.3 or newer" in f.fix for f in errors["8.6"])


def test_build_says_which_tensorrt_reads_the_weights_before_any_work(ckpt, tmp_path, capsys):
    """Printed before the checkpoint loads: a build that then fails has said it already."""
    out = tmp_path / "never"
    with pytest.raises(Exception):
        build(BuildOptions(model=str(tmp_path / "missing"), out=str(out), weights="int4", weights_format="qdq",
                           progress=False, block_size=BLOCK))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("TensorRT and int4 weights as qdq: TensorRT 10.13 (JetPack 7.0 and 7.1), 10.16 "
                            "(JetPack 7.2), 11.0 (current release line) parses them; 10.3 (JetPack 6.1 and 6.2) "
                            "should, by its parser's source, though opset 21 is past the range its documents state")
    assert f"python -m tools.trtexec {out} --graph layer_00 --run" in first
    assert first.endswith("8.5, 8.6 cannot (DequantizeLinear on INT4: this parser has no INT4)")
    with pytest.raises(Exception):
        build(BuildOptions(model=str(tmp_path / "missing"), out=str(out), weights="int8", progress=False))
    assert capsys.readouterr().out.splitlines()[0] == (
        "TensorRT: no version's parser reads int8 weights as matmulnbits (8.5, 8.6, 10.3, 10.13, 10.16, 11.0: "
        "com.microsoft::MatMulNBits is not an ONNX operator): this artifact is for ONNX Runtime; for TensorRT "
        "10+ export int4 with --quant-format qdq, or --weights float")


def test_verify_passes_a_quantized_artifact_reporting_what_it_does_not_require(int4_dir, capsys):
    assert export_main(["verify", str(int4_dir), "-q"]) == 0
    report = capsys.readouterr().out
    assert "int4: weights' relative error" in report and "tolerance 0.2; max |diff|" in report
    assert "[skip] TensorRT 10.3 parser: cannot parse this artifact's matmulnbits weights (com.microsoft::" \
           "MatMulNBits is not an ONNX operator; not required: the format is for ONNX Runtime; for TensorRT " \
           "re-export int4 with --quant-format qdq" in report
    assert "[  ok] TensorRT" not in report
    assert report.strip().endswith("PASSED")


def test_verify_of_a_qdq_artifact_skips_8x_and_warns_on_10_3(ckpt, tmp_path, capsys):
    """The qdq format is for TensorRT 10+: 8.x cannot read INT4 (skipped, with why), 10.3 reads it
    past its documented opsets (a warning to confirm on the device), 10.13 and 10.16 parse it."""
    out = tmp_path / "qdq"
    _build(ckpt, out, weights="int4", weights_format="qdq")
    capsys.readouterr()
    assert export_main(["verify", str(out), "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    parsers = {line.split(" parser:")[0].strip(): line for line in lines if " parser:" in line}
    assert parsers["[skip] TensorRT 8.6"].startswith(
        "  [skip] TensorRT 8.6 parser: cannot parse this artifact's qdq weights (DequantizeLinear on INT4: this "
        "parser has no INT4; not required: the format is for TensorRT 10.3, 10.13, 10.16, 11.0;")
    assert "[warn] TensorRT 10.3" in parsers
    assert "[  ok] TensorRT 10.13" in parsers and "[  ok] TensorRT 10.16" in parsers
    assert len(parsers) == 4  # the default versions: 8.6, 10.3, 10.13, 10.16
    assert lines[-1] == "PASSED"


def test_a_block_size_no_size_allows_is_named_as_such():
    with pytest.raises(InvalidArgumentError, match=r"does not divide the model's ffn dim 56: .*no block size of 16 "
                                                   r"or more divides them all \(their largest common power of two is 8\)"):
        QuantConfig(weights="int4", block_size=16).check_sizes(64, 56, 64)
