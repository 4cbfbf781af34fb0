"""The embedding as a row lookup (runtime.artifact.embed_table): export records the table of a Llama-family
embedding, checks the lookup against the graph, and the ONNX Runtime backend looks rows up instead
of running the graph, giving the graph's values and the same tokens; a manifest whose entry does
not fit its file is refused; OPT's embedding (positions from the mask) stays a graph."""

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

import runtime
from export.build import BuildOptions, build
from runtime.errors import ArtifactError
from tests.conftest import PROMPTS
from tests.families import save_tiny_checkpoint

NEW = 10


@pytest.fixture(scope="module", params=["float32", "float16"])
def llama(request, tmp_path_factory):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama3")
    out = tmp_path_factory.mktemp("artifact") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), dtype=request.param, progress=False), log=lambda *_: None)
    return out


def _graph_embed(artifact, ids):
    session = ort.InferenceSession(str(artifact / "embed.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids, "attention_mask": np.ones((ids.shape[0], 9), np.int64)})[0]


def test_export_records_and_checks_the_table_of_a_llama_embedding(llama):
    m = json.loads((llama / "manifest.json").read_text())
    vocab, hidden = m["model"]["vocab_size"], m["model"]["hidden_size"]
    assert m["embed_table"] == {"file": "weights.bin", "offset": m["embed_table"]["offset"], "shape": [vocab, hidden]}
    check = next(g for g in m["checks"]["graphs"] if g["graph"] == "embed.table")
    assert check["passed"] and check["max_abs_diff"] == 0.0


def test_backend_looks_rows_up_instead_of_running_the_graph(llama):
    gen = runtime.load(llama, backend="onnxruntime")
    backend = gen.engine.backend
    assert "embed" not in backend._sessions  # no session opened for it
    vocab = gen.manifest.model.vocab_size
    ids = np.array([[0, 5, vocab - 1], [7, 7, 3]], dtype=np.int64)  # (B, T), the vocabulary's ends too
    got = backend.embed(ids, np.ones((2, 9), np.int64))
    expected = _graph_embed(llama, ids)
    assert got.dtype == expected.dtype and got.shape == expected.shape == (2, 3, gen.manifest.model.hidden_size)
    np.testing.assert_array_equal(got, expected)


def test_an_artifact_without_the_entry_runs_the_graph_to_the_same_tokens(llama, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(llama, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["embed_table"]  # as export wrote it before the lookup
    (old / "manifest.json").write_text(json.dumps(m))
    graph, lookup = runtime.load(old), runtime.load(llama)
    assert "embed" in graph.engine.backend._sessions
    for options in ({}, {"speedup": 2}):
        a = graph.generate(PROMPTS, NEW, ignore_eos=True, **options)
        b = lookup.generate(PROMPTS, NEW, ignore_eos=True, **options)
        assert a.token_ids == b.token_ids


@pytest.mark.parametrize("change, message", [
    (lambda e: e.update(offset=10**9), "embed_table ends at byte 1000"),
    (lambda e: e.update(shape=[e["shape"][0], 3]), "embed_table shape [512, 3] is not [vocab_size, hidden_size] = [512, 40]"),
    (lambda e: e.update(file="other.bin"), "embed_table file 'other.bin' has no sha256 entry"),
    (lambda e: e.update(offset=-4), "embed_table offset -4 is not an int >= 0"),
])
def test_an_entry_that_does_not_fit_its_file_is_refused(llama, tmp_path, change, message):
    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    m = json.loads((broken / "manifest.json").read_text())
    change(m["embed_table"])
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="rebuild it") as info:
        runtime.load(broken)
    assert message in str(info.value)


def test_opt_embedding_reads_positions_so_it_stays_a_graph(artifact_dir):
    m = json.loads((artifact_dir / "manifest.json").read_text())
    assert "embed_table" not in m
    assert "embed" in runtime.load(artifact_dir).engine.backend._sessions


def test_a_table_inside_its_graph_stays_a_graph(tmp_path):
    # external_data="never": self-contained graphs, no shared file to look rows up in
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "llama3")
    out = tmp_path / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), external_data="never", progress=False), log=lambda *_: None)
    assert "embed_table" not in json.loads((out / "manifest.json").read_text())
    gen = runtime.load(out)
    assert "embed" in gen.engine.backend._sessions
    assert len(gen.generate(PROMPTS, NEW, ignore_eos=True).token_ids[0]) == NEW
