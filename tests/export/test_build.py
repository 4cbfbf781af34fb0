import importlib.util
import json
import re
import shutil

import numpy as np
import onnx
import pytest

import runtime
from export import build as build_module
from export.__main__ import main as export_main
from export.build import BuildOptions, build
from runtime.artifact.manifest import MANIFEST_NAME, load_manifest, sha256_file
from runtime.errors import ArtifactError
from tests.conftest import PROMPTS, save_tiny_checkpoint

quiet = dict(log=lambda *_: None)


def test_artifact_is_self_contained(artifact_dir, checkpoint_dir):
    manifest = load_manifest(artifact_dir)
    L = manifest.model.num_layers
    assert [g.name for g in manifest.graphs] == ["embed", *(f"layer_{i:02d}" for i in range(L)), "head"]
    for rel, entry in manifest.files.items():
        assert sha256_file(artifact_dir / rel) == entry["sha256"]
    assert "tokenizer/tokenizer.json" in manifest.files
    assert manifest.checks["passed"] and len(manifest.checks["graphs"]) == L + 2
    assert manifest.source["location"] == str(checkpoint_dir.resolve())
    assert manifest.policy == {"max_layers": L, "min_layers": L, "warmup_layers": 1, "horizon": None}
    layer = onnx.load(str(artifact_dir / "layer_00.onnx"))
    assert [i.name for i in layer.graph.input] == ["hidden_states", "attention_mask", "past_key", "past_value"]
    assert [o.name for o in layer.graph.output] == ["hidden_states_out", "new_key", "new_value"]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in layer.graph.input}
    assert dims["past_key"] == ["batch", 4, 8, "past_sequence"]  # (B, nh, hd, W): K stored transposed
    assert dims["past_value"] == ["batch", 4, "past_sequence", 8]  # (B, nh, W, hd)
    assert dims["attention_mask"] == ["batch", "total_sequence"]  # W + T
    assert manifest.graph("layer_00").inputs[2].dims == ["batch", 4, 8, "past_sequence"]
    assert manifest.kv_cache == {"layout": "rows", "page_size": 32}


def test_layer_and_embed_read_only_the_valid_past(artifact_dir):
    """What the rows layout relies on: a graph's outputs depend on the valid columns of the bound
    past alone, not on its width (whole pages of any number) or on what masked columns hold."""
    from export.parity import ort_session

    rng = np.random.default_rng(0)
    B, T, valid = 2, 3, 5
    hidden = rng.standard_normal((B, T, 32)).astype(np.float32)
    key, value = rng.standard_normal((B, 4, 8, valid)), rng.standard_normal((B, 4, valid, 8))
    ids = rng.integers(0, 512, (B, T))
    layer, embed = ort_session(artifact_dir / "layer_00.onnx"), ort_session(artifact_dir / "embed.onnx")
    runs = []
    for width in (32, 96):  # one page, three pages: garbage in every column past the valid ones
        past_key = (rng.standard_normal((B, 4, 8, width)) * 5).astype(np.float32)
        past_value = (rng.standard_normal((B, 4, width, 8)) * 5).astype(np.float32)
        past_key[..., :valid], past_value[:, :, :valid] = key, value
        mask = np.zeros((B, width + T), np.int64)
        mask[:, :valid] = mask[:, width:] = 1
        mask[0, :2] = 0  # left padding in row 0
        runs.append((layer.run(None, {"hidden_states": hidden, "attention_mask": mask, "past_key": past_key,
                                      "past_value": past_value}),
                     embed.run(None, {"input_ids": ids, "attention_mask": mask})))
    (layer_a, embed_a), (layer_b, embed_b) = runs
    assert [o.shape for o in layer_a] == [(B, T, 32), (B, 4, T, 8), (B, 4, T, 8)]
    for a, b in zip([*layer_a, *embed_a], [*layer_b, *embed_b]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _elem_types(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.input})
    return inferred, types


def test_fp16_keeps_softmax_and_layer_norm_in_fp32(checkpoint_dir, tmp_path):
    out = tmp_path / "fp16"
    manifest = build(BuildOptions(model=str(checkpoint_dir), out=str(out), dtype="float16", progress=False), **quiet)
    assert manifest.checks["passed"]
    graph, types = _elem_types(onnx.load(str(out / "layer_01.onnx")))
    sensitive = [n for n in graph.graph.node if n.op_type in ("Softmax", "LayerNormalization")]
    assert sensitive, "expected Softmax and LayerNormalization nodes"
    for node in sensitive:
        assert types[node.input[0]] == onnx.TensorProto.FLOAT, f"{node.op_type} runs in fp16"
    assert graph.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    # A fully masked (left padding) row stays finite in fp16.
    from export.parity import ort_session

    session = ort_session(out / "layer_01.onnx")
    hidden = np.random.default_rng(0).standard_normal((2, 3, 32)).astype(np.float16)
    page = 32  # the default page size; a prefill binds its rows' past one page wide, all masked
    mask = np.concatenate([np.zeros((2, page), np.int64), np.array([[0, 0, 0], [1, 1, 1]], np.int64)], axis=1)
    # what earlier occupants of the rows left: finite garbage, masked
    past_key = (np.random.default_rng(1).standard_normal((2, 4, 8, page)) * 3).astype(np.float16)  # (B, nh, hd, W)
    past_value = (np.random.default_rng(2).standard_normal((2, 4, page, 8)) * 3).astype(np.float16)  # (B, nh, W, hd)
    outputs = session.run(None, {"hidden_states": hidden, "attention_mask": mask, "past_key": past_key,
                                 "past_value": past_value})
    assert all(np.isfinite(o).all() for o in outputs)


def _external(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def test_weights_live_once_in_one_shared_file(checkpoint_dir, artifact_dir, hf_model):
    """Every graph references weights.bin; the tied embedding is stored once and used by the head
    in its own (vocab, hidden) layout; no graph transposes a weight at load (ONNX Runtime would
    fold each Transpose into a second copy)."""
    manifest = load_manifest(artifact_dir)
    assert {g.data_file for g in manifest.graphs} == {"weights.bin"}
    assert "weights.bin" in manifest.files
    params = {id(p): p for p in hf_model.parameters()}  # the tied lm_head counted once
    big = [4 * p.numel() for p in params.values() if 4 * p.numel() >= 1024]  # smaller stay inline
    size = (artifact_dir / "weights.bin").stat().st_size
    assert sum(big) <= size < sum(big) + 4096 * len(big)  # + at most a page of alignment each
    embed = onnx.load(str(artifact_dir / "embed.onnx"), load_external_data=False)
    head = onnx.load(str(artifact_dir / "head.onnx"), load_external_data=False)
    table = next(t for t in embed.graph.initializer if t.name == "embed_tokens.weight")
    tied = next(t for t in head.graph.initializer if t.name == "lm_head.weight")
    assert _external(tied) == _external(table) and list(tied.dims) == list(table.dims)
    gemm = [n for n in head.graph.node if n.op_type == "Gemm"]
    assert len(gemm) == 1 and gemm[0].input[1] == "lm_head.weight"
    assert onnx.helper.get_attribute_value(gemm[0].attribute[0]) == 1  # transB
    for g in manifest.graphs:
        proto = onnx.load(str(artifact_dir / g.file), load_external_data=False)
        inits = {t.name for t in proto.graph.initializer}
        assert not [n for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
        for t in proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                assert int(_external(t)["offset"]) % 4096 == 0, "each tensor starts on a page"


def test_self_contained_graphs_generate_the_same(checkpoint_dir, artifact_dir, tmp_path):
    out = tmp_path / "inline"
    manifest = build(BuildOptions(model=str(checkpoint_dir), out=str(out), external_data="never", progress=False), **quiet)
    assert {g.data_file for g in manifest.graphs} == {None}
    assert not (out / "weights.bin").exists()
    a = runtime.generate(out, PROMPTS, max_new_tokens=8)
    b = runtime.generate(artifact_dir, PROMPTS, max_new_tokens=8)
    assert a.token_ids == b.token_ids


def test_interrupted_export_leaves_nothing_loadable(checkpoint_dir, tmp_path, monkeypatch):
    out = tmp_path / "model"
    real = build_module.export_graph
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(build_module, "export_graph", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False), **quiet)
    assert list(tmp_path.iterdir()) == [], "neither --out nor a temporary directory is left"
    with pytest.raises(ArtifactError, match="does not exist"):
        runtime.load(out)


def test_killed_export_is_refused_by_load(checkpoint_dir, tmp_path, monkeypatch):
    """A process killed mid-export cannot clean up: what it leaves has no manifest."""
    out = tmp_path / "model"
    monkeypatch.setattr(build_module.shutil, "rmtree", lambda *a, **k: None)  # as if killed
    monkeypatch.setattr(build_module.Manifest, "save", lambda self, d: (_ for _ in ()).throw(SystemExit(9)))
    with pytest.raises(SystemExit):
        build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False), **quiet)
    assert not out.exists()
    [leftover] = tmp_path.iterdir()
    assert leftover.name.startswith(".model.tmp-") and (leftover / "layer_00.onnx").is_file()
    with pytest.raises(ArtifactError, match="has no manifest.json: it is not an export, or the export was interrupted"):
        runtime.load(leftover)


def test_failed_rebuild_keeps_the_old_artifact(checkpoint_dir, artifact_dir, tmp_path, monkeypatch):
    out = tmp_path / "model"
    shutil.copytree(artifact_dir, out)
    before = (out / MANIFEST_NAME).read_text()
    monkeypatch.setattr(build_module, "export_graph", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False), **quiet)
    assert (out / MANIFEST_NAME).read_text() == before
    load_manifest(out)  # every hash still matches


def test_rebuild_replaces_an_artifact(checkpoint_dir, tmp_path):
    out = tmp_path / "model"
    build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False, check=False), **quiet)
    manifest = build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False, check=False,
                                  policy={"speedup": 2}), **quiet)
    assert load_manifest(out).policy == manifest.policy != {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_refuses_to_overwrite_a_foreign_directory(checkpoint_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="is not empty and is not an artifact directory"):
        build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False), **quiet)
    assert (out / "notes.txt").read_text() == "keep me"


def test_cli_build_and_verify(checkpoint_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert export_main(["build", "--model", str(checkpoint_dir), "--out", str(out), "-q", "--speedup", "2"]) == 0
    assert json.loads((out / MANIFEST_NAME).read_text())["policy"]["min_layers"] < 6
    # -q: the result line alone, on stdout (what a script captures)
    printed = capsys.readouterr()
    assert re.fullmatch(rf"wrote {re.escape(str(out))} \(\d+ graphs, [\d.]+ MB\) in [\d.]+s\n", printed.out)
    assert printed.err == ""
    # without it: what the build does and its parity table on stderr, stdout the same one line
    assert export_main(["build", "--model", str(checkpoint_dir), "--out", str(out), "--speedup", "2"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("wrote ") and printed.out.count("\n") == 1
    assert "loading " in printed.err and "max |diff|" in printed.err and "next: python -m export verify" in printed.err
    assert export_main(["verify", str(out), "-q"]) == 0
    report = capsys.readouterr().out
    assert "full depth vs transformers: 3 prompts, 16 new tokens, greedy: identical tokens" in report
    assert "identical tokens to the PyTorch reference" in report
    assert report.strip().endswith("PASSED")


def test_cli_reports_unknown_model(tmp_path, capsys):
    assert export_main(["build", "--model", "opt-7b", "--out", str(tmp_path / "x")]) == 2
    assert "error: unknown model 'opt-7b'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_post_ln_checkpoint_exports(tmp_path):
    """A second seed and a 350m-style model with different head counts still pass every check."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "post_ln_350m", seed=3, num_attention_heads=2)
    manifest = build(BuildOptions(model=str(ckpt), out=str(tmp_path / "a"), progress=False), **quiet)
    assert manifest.checks["passed"] and not manifest.model.pre_layer_norm


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed")
def test_cli_engine_trt_without_tensorrt_fails_before_exporting(checkpoint_dir, tmp_path, capsys):
    out = tmp_path / "trt"
    assert export_main(["build", "--model", str(checkpoint_dir), "--out", str(out), "-q", "--engine", "trt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: TensorRT is not installed") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []  # nothing exported: the check comes before the work


KILLED_BUILD = """
import os, signal, sys
from export.build import BuildOptions, build
from runtime.artifact import swap
swap._exchange = lambda a, b: False  # the two-rename path: the one with a moment without --out
swap._hook = lambda step: step == "moved-old" and os.kill(os.getpid(), signal.SIGKILL)
build(BuildOptions(model=sys.argv[1], out=sys.argv[2], progress=False, check=False), log=lambda *_: None)
"""


def test_build_killed_mid_swap_is_restored_by_load_and_cleaned_by_the_next_build(checkpoint_dir, artifact_dir, tmp_path):
    import signal
    import subprocess
    import sys

    out = tmp_path / "model"
    shutil.copytree(artifact_dir, out)
    done = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(checkpoint_dir), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not out.exists() and len(list(tmp_path.glob(".model.*"))) == 2  # the worst moment
    assert runtime.load(out, threads=1).generate("Hello", 2).stats.new_tokens >= 1  # load restores it
    assert [p.name for p in tmp_path.glob(".model.*")][0].startswith(".model.old-")
    build(BuildOptions(model=str(checkpoint_dir), out=str(out), progress=False, check=False), **quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the dead build's leftover is gone
