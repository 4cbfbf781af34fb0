"""``export build --draft-layers int8|int4``: each fused layer graph again with its products quantized,
checked against the module holding those weights, listed in the manifest, verified by ``export
verify``, run by lossless rows' draft steps on ONNX Runtime while the tokens stay full depth's;
refused where it cannot be built, before any graph is written."""

from __future__ import annotations

import pytest

import runtime
from export.__main__ import main as export_main
from export.build import BuildOptions, build
from export.verify import verify
from runtime.manifest import DRAFT_HEAD, DRAFT_LAYERS, load_manifest
from tests.conftest import PROMPTS
from tests.families import save_tiny_checkpoint

BLOCK = 16  # divides the tiny Llama's widths


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("draft-layers-ckpt"), "llama3", hidden_size=64,
                                intermediate_size=128)


@pytest.fixture(scope="module")
def artifact(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft-layers-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, draft_layers="int8", draft_head="none",
                       block_size=BLOCK), log=lambda *_: None)
    return out


def test_a_default_build_writes_int8_drafts_where_they_run(ckpt, tmp_path):
    """What `--lossless` needs to pay comes with a plain `export build` (docs/benchmarks.md, "Draft
    layers"); builds whose drafts cannot run them, or run their own quantized layers, get none."""
    lines = []
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "default"), progress=False), log=lines.append)
    m = load_manifest(tmp_path / "default")
    assert m.weights == {DRAFT_HEAD: "int8", DRAFT_LAYERS: "int8"} and not m.quantized
    assert len(m.draft_layers) == m.model.num_layers and m.draft_head is not None
    assert any("--draft-head/--draft-layers none to leave them out" in line for line in lines)
    for name, options in {"int8": dict(weights="int8"), "no-fused": dict(fused=False),
                          "none": dict(draft_head="none", draft_layers="none")}.items():
        build(BuildOptions(model=str(ckpt), out=str(tmp_path / name), progress=False, **options), log=lambda *_: None)
        m = load_manifest(tmp_path / name)
        assert m.draft_head is None and not m.draft_layers and DRAFT_HEAD not in m.weights, name


def test_manifest_lists_a_draft_per_fused_layer_and_their_checks(artifact):
    m = load_manifest(artifact)
    assert [g.name for g in m.draft_layers] == [g.name for g in m.fused] == [g.name for g in m.layers]
    assert [g.file for g in m.draft_layers] == [f"layer_{i:02d}.draft.onnx" for i in range(m.model.num_layers)]
    assert all(d.inputs == f.inputs and d.outputs == f.outputs for d, f in zip(m.draft_layers, m.fused))
    assert m.weights == {DRAFT_LAYERS: "int8"} and not m.quantized  # what a plain load runs stays float
    checks = [g for g in m.checks["graphs"] if g["graph"].endswith(".draft")]
    assert len(checks) == m.model.num_layers
    assert all(c["passed"] and c["weights"] == "int8" and c["weight_error"] < 0.02 for c in checks)
    assert all(g.file in m.files for g in m.draft_layers)


@pytest.mark.parametrize("speedup", [2.0, 3.0])
def test_drafts_run_the_draft_layers_and_tokens_stay_full_depths(artifact, speedup):
    g = runtime.load(artifact, max_batch=4, check_hashes=False)
    try:
        full = g.generate(PROMPTS, 24, ignore_eos=True).token_ids
        drafts, run = [], g.backend._draft_fused.run
        g.backend._draft_fused.run = lambda *a, **k: drafts.append(a[2]) or run(*a, **k)
        verified = []
        plain = g.backend._fused.run
        g.backend._fused.run = lambda *a, **k: verified.append(a[3].shape[1]) or plain(*a, **k)
        result = g.generate(PROMPTS, 24, ignore_eos=True, speedup=speedup, lossless=True)
        assert result.token_ids == full
        assert drafts and result.stats.drafted_tokens > 0  # the drafts ran the draft graphs ...
        assert max(verified) > 1  # ... and the verify passes the float ones, several tokens a pass
    finally:
        g.close()


def test_export_verify_checks_them(artifact, ckpt):
    report = verify(artifact, model=str(ckpt), prompts=PROMPTS, max_new_tokens=8, log=lambda *_: None,
                    progress=False)
    assert report.passed, "\n".join(report.lines)
    graphs = next(line for line in report.lines if "] graphs:" in line)
    assert "draft layer graphs" in graphs and "int8: weights' relative error" in graphs


def test_refused_without_fused_layers_beside_quantized_layers_and_for_blocks_that_do_not_fit(
        ckpt, tmp_path, capsys):
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "x"), "-q",
                        "--no-fused", "--draft-layers", "int8"]) == 2
    assert ("--draft-layers quantizes the fused layer graphs, and this export writes none (not asked for "
            "(--no-fused)); drop --draft-layers") in capsys.readouterr().err
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "y"), "-q",
                        "--weights", "int8", "--draft-layers", "int4"]) == 2
    assert ("draft layers (int4) beside int8 layers: the layers are already quantized and drafts run them; "
            "drop --draft-layers") in capsys.readouterr().err
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "z"), "-q",
                        "--draft-layers", "int8", "--block-size", "128"]) == 2
    assert ("--draft-layers: block_size 128 does not divide the model's hidden size 64: weight-only "
            "quantization needs whole blocks along each weight's input dimension; pass --block-size 64 (or a "
            "smaller power of two >= 16)") in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "xyz")


def test_a_manifest_whose_draft_layers_do_not_add_up_is_refused(artifact, tmp_path):
    import json
    import shutil

    from runtime.errors import ArtifactError

    for name, edit, message in [
            ("weights", lambda d: d["weights"].pop(DRAFT_LAYERS),
             "lists draft layer graphs but weights.layers_draft is None, not 'int8' or 'int4'"),
            ("names", lambda d: d["draft_layers"].pop(),
             "lists draft layer graphs ['layer_00', 'layer_01', 'layer_02', 'layer_03'], expected one per "
             "fused layer graph ['layer_00', 'layer_01', 'layer_02', 'layer_03', 'layer_04']")]:
        copy = tmp_path / name
        shutil.copytree(artifact, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_manifest(copy)
