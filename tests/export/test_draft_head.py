"""``export build --draft-head int8|int4``: a quantized copy of the float head beside it, checked
against the head's module at its own precision, listed in the manifest, verified by ``export
verify``; refused where it cannot help or cannot be built, before any graph is written."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from export.__main__ import main as export_main
from export.build import BuildOptions, build
from export.verify import verify
from runtime.artifact.manifest import DRAFT_HEAD, load_manifest
from tests.conftest import PROMPTS
from tests.families import save_tiny_checkpoint

BLOCK = 16  # divides the tiny Llama's hidden 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Llama 3.2's tied head: the draft head quantizes the embedding's matrix, the head keeps reading it
    return save_tiny_checkpoint(tmp_path_factory.mktemp("draft-ckpt"), "llama3", hidden_size=64)


@pytest.fixture(scope="module")
def artifact(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, draft_head="int4", block_size=BLOCK),
          log=lambda *_: None)
    return out


def test_manifest_lists_the_draft_head_and_its_check(artifact):
    m = load_manifest(artifact)
    assert m.draft_head.name == DRAFT_HEAD and m.draft_head.file == "head_draft.onnx"
    assert m.draft_head.inputs == m.head.inputs and m.draft_head.outputs == m.head.outputs
    assert m.weights == {DRAFT_HEAD: "int4"} and not m.quantized  # the graphs a plain load runs stay float
    assert m.graph_weights(DRAFT_HEAD) == "int4" and m.graph_weights("head") == "float"
    check = next(g for g in m.checks["graphs"] if g["graph"] == DRAFT_HEAD)
    assert check["passed"] and check["weights"] == "int4" and check["weight_error"] < 0.2
    assert "head_draft.onnx" in m.files


def test_draft_logits_are_the_heads_at_int4(artifact):
    gen = runtime.load(artifact, check_hashes=False)
    try:
        hidden = np.random.default_rng(0).standard_normal((3, 1, 64)).astype(np.float32)  # (R, 1, D)
        head, draft = gen.backend.head(hidden), gen.backend.draft_head(hidden)  # (R, V) each
        assert not np.array_equal(head, draft)  # a graph of its own, not the head again
        assert np.linalg.norm(draft - head) / np.linalg.norm(head) < 0.2
    finally:
        gen.close()


def test_export_verify_checks_it(artifact, ckpt):
    report = verify(artifact, model=str(ckpt), prompts=PROMPTS, max_new_tokens=8, log=lambda *_: None,
                    progress=False)
    assert report.passed, "\n".join(report.lines)
    graphs = next(line for line in report.lines if "] graphs:" in line)
    assert "int4: weights' relative error" in graphs and "(head_draft)" in graphs


def test_refused_beside_a_quantized_head_and_for_blocks_that_do_not_fit(ckpt, tmp_path, capsys):
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "x"), "-q",
                        "--head-weights", "int8", "--draft-head", "int4"]) == 2
    assert ("a draft head (int4) beside an int8 head: the head is already quantized and drafts read it; "
            "drop --draft-head") in capsys.readouterr().err
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "y"), "-q",
                        "--draft-head", "int8", "--block-size", "128"]) == 2
    assert ("--draft-head: block_size 128 does not divide the head's input width 64; pass --block-size "
            "with a power of two that divides it") in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
