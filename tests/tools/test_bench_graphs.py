"""tools.bench.graphs: candidates side by side in one process, IOBinding equal to plain runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools.bench import graphs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools.bench.prepare import prepare

    return prepare("tiny-random", tmp_path_factory.mktemp("bench"), log=lambda *a: None)


def test_bound_outputs_give_the_plain_runs_logits(tiny):
    import onnxruntime as ort

    model = None
    runners = []
    for text in (f"plain={tiny.artifact_dir}", f"bound={tiny.artifact_dir}:bind:noprepack"):
        c = graphs.parse_candidate(text)
        model = graphs.load(ort, c, threads=1, profile_dir=None)
        runners.append(graphs.Runner(c, model, width=64, valid=40))
    plain, bound = (r.step() for r in runners)
    assert bound.shape == (1, 1, model["vocab_size"])
    np.testing.assert_allclose(bound, plain, atol=1e-5, rtol=1e-5)
    assert bound.any()


def test_a_batch_of_rows_gives_each_row_the_single_rows_logits(tiny):
    import onnxruntime as ort

    c = graphs.parse_candidate(f"a={tiny.artifact_dir}:bind")
    model = graphs.load(ort, c, threads=1, profile_dir=None)
    single = graphs.Runner(c, model, width=64, valid=40)
    batch = graphs.Runner(c, model, width=64, valid=40, batch=4)
    for (k1, v1), (k4, v4) in zip(single.past, batch.past):
        k4[2], v4[2] = k1[0], v1[0]  # row 2 of the batch holds the single row's past
    one, four = single.step(), batch.step()
    assert four.shape == (4, 1, model["vocab_size"])
    np.testing.assert_allclose(four[2], one[0], atol=1e-5, rtol=1e-5)
    assert not np.allclose(four[1], four[2])  # the other rows have pasts of their own


def test_a_grouped_query_attention_artifact_binds_the_kv_heads_past(tmp_path):
    """SmolLM2's 3 query heads over 1 KV head: the past holds the KV heads only (it crashed with
    "past_key index 1 Got: 3 Expected: 1" when sized by the query heads)."""
    import onnxruntime as ort

    from export.build import BuildOptions, build
    from tests.families import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "smollm2")
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    for options in ("", ":bind"):
        c = graphs.parse_candidate(f"a={tmp_path / 'art'}{options}")
        model = graphs.load(ort, c, threads=1, profile_dir=None)
        assert model["num_kv_heads"] < model["num_heads"]
        logits = graphs.Runner(c, model, width=32, valid=20).step()
        assert logits.shape == (1, 1, model["vocab_size"]) and np.isfinite(logits).all()


def test_cli_table_profile_and_json(tiny, tmp_path, capsys):
    out = tmp_path / "g.json"
    code = graphs.main([f"a={tiny.artifact_dir}", f"b={tiny.artifact_dir}:bind", "--steps", "3",
                        "--warmup", "1", "--threads", "1", "--bandwidth-mib", "8",
                        "--profile", str(tmp_path / "prof"), "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| a |" in text and "| b |" in text
    assert "a layer: µs per call:" in text and "MatMul" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["candidate"] for r in rows] == ["a", "b"]
    # the floor counts layers and head, not the embedding table (a step reads only its rows)
    weights = sum(graphs.initializer_bytes(tiny.artifact_dir / f"{g}.onnx")
                  for g in ["head", *(f"layer_{i:02d}" for i in range(tiny.config["num_layers"]))])
    assert rows[0]["weight_mb"] == pytest.approx(weights / 1e6)


@pytest.mark.parametrize("args, message", [
    (["nodir"], "write NAME=DIR"),
    (["a=/nonexistent"], "holds no manifest.json"),
    (["a={art}:fast"], "unknown option(s) ['fast']"),
    (["a={art}", "a={art}"], "candidate names must differ"),
    (["a={art}", "--valid", "80"], "--valid 80 exceeds --width 64"),
])
def test_bad_arguments_exit_2_with_one_error_line(tiny, capsys, args, message):
    args = [a.replace("{art}", str(tiny.artifact_dir)) for a in args]
    assert graphs.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]
