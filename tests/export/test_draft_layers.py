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
from runtime.artifact.manifest import DRAFT_HEAD, DRAFT_LAYERS, load_manifest
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


def _adapter(ckpt, out, seed: int):
    """A LoRA adapter over ``ckpt`` with random (non-zero) B matrices: layers unlike the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    from tools.finetune import lora

    pytest.importorskip("peft")
    torch.manual_seed(seed)
    model = lora.inject(AutoModelForCausalLM.from_pretrained(ckpt), 4, 8.0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    lora.save(model, out, 4, 8.0, str(ckpt))
    return out


def test_a_draft_adapter_goes_into_the_drafts_alone(ckpt, artifact, tmp_path):
    """--draft-adapter: the draft layers hold the adapter's layers, checked against them; the float
    layers, and so full depth and every lossless token, stay the model's own."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    adapter = _adapter(ckpt, tmp_path / "adapter", seed=1)
    out = tmp_path / "art"
    lines = []
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, draft_layers="int8", draft_head="none",
                       block_size=BLOCK, draft_adapter=str(adapter)), log=lines.append)
    assert any(line.startswith(f"draft layers hold {adapter} merged into") for line in lines)
    m = load_manifest(out)
    assert m.source["draft_adapter"] == str(adapter)
    assert all(c["passed"] for c in m.checks["graphs"] if c["graph"].endswith(".draft"))

    def weights(directory, file):
        proto = onnx.load(str(directory / file))
        return [numpy_helper.to_array(t) for t in proto.graph.initializer if t.data_type == onnx.TensorProto.UINT8]

    plain, adapted = weights(artifact, "layer_01.draft.onnx"), weights(out, "layer_01.draft.onnx")
    assert plain and not all(np.array_equal(a, b) for a, b in zip(plain, adapted))  # other draft weights
    # ... and the same float layers: full depth's tokens and log-probabilities to the bit, lossless's tokens
    with runtime.load(out, max_batch=4, check_hashes=False) as g:
        full = g.generate(PROMPTS, 16, ignore_eos=True, logprobs=0)
        assert g.generate(PROMPTS, 16, ignore_eos=True, speedup=2, lossless=True).token_ids == full.token_ids
    with runtime.load(artifact, max_batch=4, check_hashes=False) as g:
        own = g.generate(PROMPTS, 16, ignore_eos=True, logprobs=0)
    assert own.token_ids == full.token_ids
    assert [[t.logprob for t in row] for row in own.logprobs] == [[t.logprob for t in row] for row in full.logprobs]
    report = verify(out, model=str(ckpt), prompts=PROMPTS, max_new_tokens=8, log=lambda *_: None, progress=False)
    assert report.passed, "\n".join(report.lines)  # its drafts judged against the adapter's layers


def test_a_draft_adapter_is_refused_without_draft_layers_or_over_another_base(ckpt, tmp_path, capsys):
    adapter = _adapter(ckpt, tmp_path / "adapter", seed=1)
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "x"), "-q", "--draft-layers",
                        "none", "--draft-adapter", str(adapter)]) == 2
    assert (f"--draft-adapter {adapter} goes into the draft layers, and this build writes none"
            in capsys.readouterr().err)
    other = save_tiny_checkpoint(tmp_path / "other", "llama3", hidden_size=64, intermediate_size=128, seed=5)
    assert export_main(["build", "--model", str(other), "--out", str(tmp_path / "y"), "-q", "--draft-layers",
                        "int8", "--block-size", str(BLOCK), "--draft-adapter", str(adapter)]) == 2
    assert "not over this model (" in capsys.readouterr().err
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "z"), "-q", "--draft-layers",
                        "int8", "--block-size", str(BLOCK), "--draft-adapter", str(ckpt)]) == 2
    assert "not a LoRA adapter directory" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "xyz")
