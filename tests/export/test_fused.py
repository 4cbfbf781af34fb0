"""The layers' fused-operator variant for ONNX Runtime (export.fused, runtime.gqa): written beside the
plain graphs for Llama-family float32 artifacts whose head_dim GroupQueryAttention's CPU kernel takes,
checked against PyTorch at export, and run by the ONNX Runtime backend to the same tokens as the plain
graphs and transformers, padded batches, skipping and chunked prompts included."""

import json

import numpy as np
import pytest

import runtime
from export.build import BuildOptions, build
from runtime.errors import ArtifactError, InvalidArgumentError, VerificationError
from runtime.gqa import call_inputs
from runtime.kvcache import MASK_VALUE, ArrayStorage
from tests.conftest import PROMPTS
from tests.export.test_build_llama import _hf, _hf_generate
from tests.families import save_tiny_checkpoint
from tests.runtime.test_generate import padded

NEW = 12
# The tiny families of tests.families at head_dim 16 (GroupQueryAttention's CPU kernel needs a multiple of 16)
GQA_SHAPES = {"llama3": dict(hidden_size=64), "smollm2": dict(hidden_size=48, intermediate_size=64), "qwen2": dict(hidden_size=96),
              "qwen3": dict(head_dim=16)}


def _build(tmp_path_factory, variant, checkpoint, **options):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp(f"{variant}-ckpt"), variant, **checkpoint)
    out = tmp_path_factory.mktemp(f"{variant}-artifact") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, **options), log=lambda *_: None)
    return ckpt, out


@pytest.fixture(scope="module", params=list(GQA_SHAPES))
def exported(request, tmp_path_factory):
    return (request.param, *_build(tmp_path_factory, request.param, GQA_SHAPES[request.param]))


def _steps(gen, new=NEW, prompts=PROMPTS, **options):
    stream = gen.stream(prompts, new, ignore_eos=True, **options)
    return stream, [event.logits for event in stream]


def test_the_manifest_lists_a_checked_fused_graph_per_layer(exported):
    _, _, art = exported
    m = json.loads((art / "manifest.json").read_text())
    layers = [g["name"] for g in m["graphs"][1:-1]]
    assert [g["name"] for g in m["fused"]] == layers
    assert all((art / g["file"]).is_file() and g["file"] in m["files"] for g in m["fused"])
    checked = {g["graph"]: g for g in m["checks"]["graphs"]}
    assert all(checked[f"{name}.gqa"]["passed"] for name in layers)
    inputs = [t["name"] for t in m["fused"][0]["inputs"]]
    assert inputs[:2] == ["hidden_states", "attention_bias"] and "attention_mask" not in inputs
    # the products' weights are the plain graphs': weights.bin stores them once
    assert all(g["data_file"] == "weights.bin" for g in m["fused"])


def test_full_depth_equals_transformers_generate(exported):
    variant, ckpt, art = exported
    model, tok = _hf(variant, ckpt)
    _, expected, hf_logits = _hf_generate(model, tok)
    with runtime.load(art, threads=1) as gen:
        assert gen.backend.fused
        stream = gen.stream(PROMPTS, NEW)
        logits = [event.logits for event in stream]
        assert padded(stream.result.token_ids, NEW) == expected
        running = [len(t) for t in stream.result.token_ids]
        for step, (a, b) in enumerate(zip(logits, hf_logits)):
            rows = [r for r, n in enumerate(running) if step < n]
            np.testing.assert_allclose(a[rows], b.numpy()[rows], atol=1e-4, rtol=0, err_msg=f"step {step}")


@pytest.mark.parametrize("options", [dict(), dict(speedup=2), dict(speedup=3, prefill_chunk=2),
                                     dict(speedup=2, prefill="policy", decay="power"),
                                     dict(speedup=2, do_sample=True, seed=3)],
                         ids=["full", "speedup2", "speedup3-chunks", "prefill-policy", "sampling"])
def test_fused_and_plain_layers_give_the_same_tokens(exported, options):
    """Left-padded prompts of several lengths, rows skipping layers under per-row budgets (a row that
    skips a layer leaves its K/V alone: query_seqlens 0), 40 tokens so the KV width grows a page."""
    _, _, art = exported
    chunk = options.pop("prefill_chunk", "auto")
    prompts = [*PROMPTS, "a"]
    with runtime.load(art, threads=1, max_batch=4, prefill_chunk=chunk) as fused, \
            runtime.load(art, threads=1, max_batch=4, fused=False, prefill_chunk=chunk) as plain:
        assert fused.backend.fused and not plain.backend.fused
        (a, a_logits), (b, b_logits) = _steps(fused, 40, prompts, **options), _steps(plain, 40, prompts, **options)
        assert a.result.token_ids == b.result.token_ids
        for x, y in zip(a_logits, b_logits, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)


def test_rows_joining_and_leaving_while_others_decode(exported):
    """The engine's packed rows: a request joins (its prompt in chunks) beside a decoding one and
    each gives the tokens it gives alone."""
    _, _, art = exported
    with runtime.load(art, threads=1, max_batch=1) as solo:
        alone = [solo.generate(p, 16, ignore_eos=True).token_ids[0] for p in PROMPTS[:2]]
    with runtime.load(art, threads=1, max_batch=3, prefill_chunk=3) as gen, gen.stepper() as stepper:
        first = stepper.add(PROMPTS[0], 16, ignore_eos=True)
        for _ in range(3):
            stepper.step()
        second = stepper.add(PROMPTS[1], 16, ignore_eos=True)
        while not stepper.done:
            stepper.step()
    assert [first.result.token_ids[0], second.result.token_ids[0]] == alone


def test_a_wrong_fused_graph_fails_the_export(tmp_path_factory, monkeypatch):
    """The check is against PyTorch: RoPE tables one position off (the graph still runs) fail it."""
    import export.fused as fused

    real = fused.rope_tables
    monkeypatch.setattr(fused, "rope_tables", lambda layer, n: tuple(np.roll(t, 1, axis=0) for t in real(layer, n)))
    with pytest.raises(VerificationError, match=r"layer_00\.gqa"):
        _build(tmp_path_factory, "smollm2", GQA_SHAPES["smollm2"])


@pytest.mark.parametrize("variant, checkpoint, options, why", [
    ("qwen3", {}, {}, "head_dim a multiple of 16, not 12"),
    ("smollm2", GQA_SHAPES["smollm2"], dict(dtype="float16"), "for float32 artifacts"),
    ("smollm2", GQA_SHAPES["smollm2"], dict(weights="int4", weights_format="qdq", block_size=16), "not qdq"),
    ("smollm2", GQA_SHAPES["smollm2"], dict(fused=False), "not asked for"),
])
def test_artifacts_without_the_variant_say_why_and_run_the_plain_graphs(tmp_path_factory, variant, checkpoint,
                                                                        options, why):
    logged = []
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), variant, **checkpoint)
    out = tmp_path_factory.mktemp("art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False, **options), log=logged.append)
    line = next(x for x in logged if x.startswith("fused layer graphs"))
    assert line.startswith("fused layer graphs for ONNX Runtime: none, ") and why in line
    assert "fused" not in json.loads((out / "manifest.json").read_text())
    with runtime.load(out, threads=1) as gen:
        assert not gen.backend.fused
    with pytest.raises(ArtifactError, match="fused=True, but this artifact has no fused layer graphs"):
        runtime.load(out, fused=True)


def test_quantized_layers_get_the_variant_on_their_own_products(tmp_path_factory):
    _, art = _build(tmp_path_factory, "smollm2", GQA_SHAPES["smollm2"], weights="int4", block_size=16)
    m = json.loads((art / "manifest.json").read_text())
    assert len(m["fused"]) == 5 and all(g["passed"] for g in m["checks"]["graphs"])
    import onnx

    graph = onnx.load(str(art / m["fused"][0]["file"]), load_external_data=False).graph
    assert sorted({n.op_type for n in graph.node}) == sorted({
        "SimplifiedLayerNormalization", "MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization",
        "Split", "Sigmoid", "Mul", "Add"})
    with runtime.load(art, threads=1) as fused, runtime.load(art, threads=1, fused=False) as plain:
        a, b = fused.generate(PROMPTS, 8, ignore_eos=True), plain.generate(PROMPTS, 8, ignore_eos=True)
        assert a.token_ids == b.token_ids


def test_a_manifest_whose_fused_list_is_not_the_layers_is_refused(exported, tmp_path):
    import shutil

    _, _, art = exported
    copy = tmp_path / "model"
    shutil.copytree(art, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["fused"] = m["fused"][:-1]
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="lists fused layer graphs"):
        runtime.load(copy)


def test_call_inputs_place_each_rows_new_positions_at_its_length():
    # row 0: 2 positions of left padding then 3 valid; row 1: 2 valid; a bound past of 8, 2 new tokens
    mask = np.array([[0, 0, 1, 1, 1, 0, 0, 0, 1, 1],
                     [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]])
    call = call_inputs(mask, np.array([5, 2]), 2, 8)
    valid = call.attention_bias[:, 0] == 0  # (R, T, W)
    assert valid[0, 0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0] and valid[1, 0].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert (call.attention_bias[:, 0][~valid] == np.float32(MASK_VALUE)).all()
    assert call.position_ids.tolist() == [[3, 4], [0, 2]]  # the plain graphs' positions, padding at 0
    seqlens_k, query_seqlens = call.seqlens(None)
    assert seqlens_k.tolist() == [6, 3] and query_seqlens.tolist() == [2, 2] and int(call.total_sequence_length) == 8
    seqlens_k, query_seqlens = call.seqlens(np.array([True, False]))  # row 1 skips the layer: its K/V stay
    assert seqlens_k.tolist() == [6, 1] and query_seqlens.tolist() == [2, 0]


def test_array_storage_keys_stored_as_values_for_the_fused_graphs():
    storage = ArrayStorage(1, 2, 4, lambda shape: np.zeros(shape, np.float32), transposed_keys=False)
    storage.allocate(3, 16, 8)
    key = np.arange(2 * 2 * 3 * 4, dtype=np.float32).reshape(2, 2, 3, 4)  # (B, nh, T, hd)
    storage.write(0, key, key + 1, np.array([0, 1]), np.array([2, 0]), np.array([1, 4]))
    k, v = storage.past(0, 0, 3)
    assert k.shape == v.shape == (3, 2, 8, 4)
    np.testing.assert_array_equal(k[2, :, 1:4], key[0])
    np.testing.assert_array_equal(k[0, :, 4:7], key[1])
    np.testing.assert_array_equal(v[0, :, 4:7], key[1] + 1)
    storage.resize(16, 3)  # a re-lay keeps each row's positions
    k, _ = storage.past(0, 0, 3)
    assert k.shape == (3, 2, 16, 4)
    np.testing.assert_array_equal(k[0, :, 4:7], key[1])


def test_verify_passes_and_the_iobinding_backend_reads_the_plain_graphs(exported):
    """export verify's transformers comparison runs the default backend (the fused graphs); the
    IOBinding backend (device="cpu") and the torch backend read the plain graphs of the same artifact."""
    from export.verify import verify

    _, _, art = exported
    report = verify(art, prompts=PROMPTS, max_new_tokens=8, log=lambda *_: None, progress=False)
    assert report.passed, "\n".join(report.lines)
    graphs = next(line for line in report.lines if "graphs vs PyTorch" in line)
    assert "and 5 fused layer graphs on the same cases" in graphs
    with runtime.load(art, threads=1, max_batch=4) as fused, \
            runtime.load(art, device="cpu", threads=1, max_batch=4) as bound, \
            runtime.load(art, backend="torch", threads=1, max_batch=4) as torch_gen:
        expected = fused.generate(PROMPTS, NEW, ignore_eos=True, speedup=2).token_ids
        assert bound.generate(PROMPTS, NEW, ignore_eos=True, speedup=2).token_ids == expected
        assert torch_gen.generate(PROMPTS, NEW, ignore_eos=True, speedup=2).token_ids == expected


def test_the_iobinding_backend_takes_fused_false_and_refuses_fused_true(exported):
    """Where onnxruntime-gpu is installed every load is the IOBinding backend's: fused=False (the
    default --no-fused passes) must not be an unknown option there, and fused=True says where it runs."""
    _, _, art = exported
    with runtime.load(art, device="cpu", threads=1, fused=False) as gen:
        assert not gen.backend.fused
    with pytest.raises(InvalidArgumentError, match=r"fused=True: the IOBinding backend .* runs the plain layer graphs"):
        runtime.load(art, device="cpu", fused=True)


OLD_ORT = ("onnxruntime 1.30.0's GroupQueryAttention takes no query_seqlens input, which the fused layer graphs give "
           "it (0 for a row that skips the layer); upgrade onnxruntime (1.32 has it) to run them")


def test_an_onnxruntime_whose_operator_is_older_gets_and_runs_the_plain_graphs(exported, tmp_path_factory,
                                                                              monkeypatch):
    """onnxruntime 1.30 (the GPU machines' here) refused every fused graph ('has input size 17 not in
    range [min=7, max=16]'), and with it the export of every Llama-family model: the export writes
    none there, saying why, and an artifact that has them runs its plain graphs, saying so."""
    from runtime import gqa

    variant, _, art = exported
    with runtime.load(art, threads=1) as gen:
        assert gen.backend.fused and gen.backend.fused_note is None  # this machine's onnxruntime runs them
        want = gen.generate(PROMPTS, NEW, ignore_eos=True).token_ids
    monkeypatch.setattr(gqa, "why_unsupported", lambda: OLD_ORT)
    with pytest.warns(UserWarning, match="running the plain layer graphs, not the fused ones: onnxruntime 1.30.0"):
        gen = runtime.load(art, threads=1)
    with gen:
        assert not gen.backend.fused and gen.backend.fused_note == OLD_ORT
        assert gen.generate(PROMPTS, NEW, ignore_eos=True).token_ids == want
    with pytest.raises(InvalidArgumentError, match="fused=True: onnxruntime 1.30.0's GroupQueryAttention takes no "
                                                   "query_seqlens input"):
        runtime.load(art, fused=True)
    logged = []
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), variant, **GQA_SHAPES[variant])
    out = tmp_path_factory.mktemp("art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False), log=logged.append)
    assert f"fused layer graphs for ONNX Runtime: none, {OLD_ORT}" in logged
    assert "fused" not in json.loads((out / "manifest.json").read_text())


def test_the_operator_probe_reads_this_onnxruntime():
    """The probe reads the operator's schema, not a version number: this machine's onnxruntime (1.32
    or later, whose GroupQueryAttention takes query_seqlens) passes it."""
    import onnxruntime

    from runtime import gqa

    version = tuple(int(x) for x in onnxruntime.__version__.split(".")[:2])
    if version >= (1, 32):
        assert gqa.why_unsupported() is None
    elif version <= (1, 30):
        assert gqa.why_unsupported().startswith(f"onnxruntime {onnxruntime.__version__}'s GroupQueryAttention")
