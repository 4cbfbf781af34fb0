"""tools.bench.gemv: an artifact's weight shapes, every kernel checked and timed, the step's floor."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tools.bench import gemv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools.bench.prepare import prepare

    return prepare("tiny-random", tmp_path_factory.mktemp("bench"), log=lambda *a: None)


def test_step_shapes_are_the_layers_and_the_tied_head(tiny):
    c = tiny.config
    D, F, V, L = c["hidden_size"], c["ffn_dim"], c["vocab_size"], c["num_layers"]
    shapes, layers = gemv.step_shapes(tiny.artifact_dir)
    assert layers == L
    # q+k+v (one product: export.weights.fuse_sibling_matmuls), out; fc1; fc2 in every layer; the
    # head reads the (vocab, hidden) table as (hidden, vocab)
    want = {(D, 3 * D): L, (D, D): L, (D, F): L, (F, D): L, (D, V): 1}
    got = {}
    for s in shapes:
        got[(s.rows, s.cols)] = got.get((s.rows, s.cols), 0) + s.per_step
    assert got == want


def test_cli_table_and_json(tiny, tmp_path, capsys):
    out = tmp_path / "g.json"
    code = gemv.main([str(tiny.artifact_dir), "--rounds", "2", "--repeats", "1", "--threads", "1",
                      "--evict-mib", "1", "--bandwidth-mib", "8", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| ort GB/s | ort-noprepack GB/s | ort-gemm GB/s | numpy GB/s |" in text
    assert "a step's products, ms" in text
    summary = json.loads(out.read_text())
    weights = sum(s["rows"] * s["cols"] * 4 * s["per_step"] for s in summary["shapes"])
    assert summary["floor_ms"] == pytest.approx(weights / summary["bandwidth"] * 1e3)
    for s in summary["shapes"]:
        assert s["copies"] == math.ceil((1 << 20) / (s["rows"] * s["cols"] * 4))  # together >= --evict-mib
        assert all(v > 0 for v in s["gbps"].values())
    assert set(summary["step_ms"]) >= {"ort", "ort-noprepack", "ort-gemm", "numpy"}


def test_time_kernel_gives_one_time_per_round_and_shape():
    shapes = [gemv.Shape(16, 24, 2), gemv.Shape(24, 16, 1)]
    seconds = gemv.time_kernel("ort", shapes, [3, 1], rounds=4, threads=1, spin=False)
    assert [len(s) for s in seconds] == [4, 4] and all(t > 0 for s in seconds for t in s)


def test_every_kernel_computes_the_same_product():
    calls = gemv.kernels(gemv.Shape(48, 80, 1), copies=2, threads=1, spin=False)
    assert set(calls) >= {"ort", "ort-noprepack", "ort-gemm", "numpy"}
    want = calls["numpy"]()
    for name, fn in calls.items():  # kernels() asserts this too, before any timing
        got = fn()
        assert len(got) == 2 and got[0].shape == (1, 80), name
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4, err_msg=name)
    assert not np.allclose(want[0], want[1])  # two different copies, not one read twice


@pytest.mark.parametrize("args, message", [
    (["{nodir}"], "holds no manifest.json; pass an artifact directory"),
    (["{art}", "--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_bad_arguments_exit_2_with_one_error_line(tiny, tmp_path, capsys, args, message):
    args = [a.replace("{art}", str(tiny.artifact_dir)).replace("{nodir}", str(tmp_path)) for a in args]
    assert gemv.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_manifest_without_layers_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"graphs": [{"name": "head"}]}))
    with pytest.raises(gemv.InvalidArgumentError, match="lists no layer graphs; re-export"):
        gemv.step_shapes(tmp_path)


def test_a_quantized_artifact_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    (tmp_path / "manifest.json").write_text(json.dumps({"graphs": [{"name": "layer_00"}, {"name": "head"}]}))
    for name in ("layer_00", "head"):
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        graph = helper.make_graph([node], name, [helper.make_tensor_value_info("x", TensorProto.INT8, [1, 4])],
                                  [helper.make_tensor_value_info("y", TensorProto.INT8, [1, 4])],
                                  [numpy_helper.from_array(np.ones((4, 4), np.int8), "w")])
        onnx.save(helper.make_model(graph), str(tmp_path / f"{name}.onnx"))
    with pytest.raises(gemv.InvalidArgumentError, match="hold no float weight matrices"):
        gemv.step_shapes(tmp_path)
