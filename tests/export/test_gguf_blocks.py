"""A quantized GGUF's blocks carried into the int4/int8 artifact as they are (export.gguf_blocks):
tiny Llama-family checkpoints written at each carried type with gguf's own quantizer; every product
of the artifact multiplies by exactly what transformers dequantizes from the file."""

import itertools
import json

import numpy as np
import onnx
import pytest
import torch

from export import checkpoint
from export.build import BuildOptions, build
from runtime.artifact.manifest import load_manifest
from export.gguf_blocks import BlockIndex, decode, dequantize
from export.quantize import dequantized_weights
from runtime.artifact.manifest import TRANSPOSED, split_fused
from tests.families import tiny_model
from tools.bench.gguf_file import write_checkpoint_gguf

gguf = pytest.importorskip("gguf")
# head_dim 16 (the fused graphs' GroupQueryAttention), every K whole blocks of 32
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_decode_gives_what_gguf_dequantizes(ggml_type):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[0] = 0.0  # a block of zeros: scale 0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[ggml_type])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])
    assert np.array_equal(dequantize(decode(ggml_type, raw)), expected)


K_SIZES = {"Q4_K": (144, [(0, 4)]), "Q5_K": (176, [(0, 4)]), "Q6_K": (210, [(208, 210)])}  # bytes, float16 fields


def random_k_blocks(shape, ggml_type: str, seed: int = 0) -> np.ndarray:
    """Valid K-quant blocks of random levels and scales for a (rows, K) matrix (gguf has no K-quant
    quantizer): random bytes, their float16 scales set to small finite values."""
    size, fields = K_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (shape[0], shape[1] // 256, size), dtype=np.uint8)
    for start, end in fields:
        halves = (rng.random((shape[0], shape[1] // 256, (end - start) // 2)) * 1e-4 + 1e-5).astype(np.float16)
        raw[..., start:end] = halves.view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_decode_gives_what_gguf_dequantizes_of_k_quants(ggml_type):
    raw = random_k_blocks((3, 512), ggml_type)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])
    rows = decode(ggml_type, raw)
    assert rows.q.shape == (3, 512 // rows.block, rows.block)
    assert np.array_equal(dequantize(rows), expected)


def _write(tmp_path, matrices: str, embedding: str = "Q8_0", shape=SHAPE, monkeypatch=None, overrides=None):
    model = tiny_model("smollm2", **shape)
    k_types = {t for t in (matrices, *(overrides or {}).values()) if t in K_SIZES}
    if k_types:  # gguf's quantize knows no K-quant: random blocks stand for the weights
        plain = gguf.quants.quantize
        qtypes = {gguf.GGMLQuantizationType[t]: t for t in k_types}
        seeds = itertools.count()  # each matrix its own blocks (equal ones would share one initializer)
        monkeypatch.setattr(gguf.quants, "quantize", lambda t, q: random_k_blocks(t.shape, qtypes[q], next(seeds))
                            if q in qtypes else plain(t, q))
    return write_checkpoint_gguf(model, checkpoint.build_tokenizer(), tmp_path / f"{matrices}.gguf",
                                 matrices=matrices, embedding=embedding, overrides=overrides)


def _file_weights(path) -> dict[str, np.ndarray]:
    """What transformers makes of the file: each layer's weights (N, K), as export traces them."""
    model, _ = checkpoint.load(checkpoint.resolve(str(path)), dtype=torch.float32)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("matrices, weights", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8"), ("Q5_0", "int8"),
                                                ("Q5_1", "int8")])
def test_a_quantized_gguf_is_carried_exactly(tmp_path, matrices, weights):
    path = _write(tmp_path, matrices)
    lines = []
    out = tmp_path / "art"
    manifest = build(BuildOptions(model=str(path), out=str(out), progress=False, weights=weights), log=lines.append)
    # the layers' 4 products each (q/k/v, o, gate/up, down), and the head: the file's Q8_0 embedding
    # at int8 (never below the file: an int4 export's head too)
    carried = manifest.weights["from_gguf"]
    assert carried == {"carried": 4 * SHAPE["num_hidden_layers"] + 1, "requantized": [],
                       "types": {matrices: 4 * SHAPE["num_hidden_layers"], "Q8_0": 1} if matrices != "Q8_0" else
                       {"Q8_0": 4 * SHAPE["num_hidden_layers"] + 1}}
    assert manifest.weights["head"] == "int8" and manifest.weights["layers"] == weights
    assert any(line.startswith(f"{matrices}.gguf: {carried['carried']} products carried") for line in lines)
    assert json.loads((out / "manifest.json").read_text())["weights"]["from_gguf"] == carried

    expected = _file_weights(path)
    for i in range(SHAPE["num_hidden_layers"]):
        for file in (f"layer_{i:02d}.onnx", f"layer_{i:02d}.gqa.onnx"):
            proto = onnx.load(str(out / file))
            if matrices == "Q4_1":  # the minimums' term rides along, in the fused graph too
                assert any(n.name.endswith("/mins/add") for n in proto.graph.node), file
            used = split_fused(dequantized_weights(proto, onnx.load(str(out / f"layer_{i:02d}.onnx"))))
            assert len(used) == 7, file
            for key, w in used.items():  # (K, N): the file's values, to float32 rounding of the product
                target = expected[f"model.layers.{i}.{key.removesuffix(TRANSPOSED)}"].T
                np.testing.assert_allclose(w, target, rtol=2e-6, atol=1e-7, err_msg=f"{file} {key}")


def test_this_projects_int4_kernel_folds_the_minimums_of_plain_and_fused_graphs(tmp_path):
    from runtime.platform import kernels

    if kernels.why_not() is not None:
        pytest.skip(f"runtime.platform.kernels cannot run here: {kernels.why_not()}")
    path = _write(tmp_path, "Q4_1")
    out = tmp_path / "art"
    build(BuildOptions(model=str(path), out=str(out), progress=False, weights="int4", check=False),
          log=lambda *_: None)
    kernel = kernels.Kernel(kernels.library()[0])
    for file in ("layer_00.onnx", "layer_00.gqa.onnx"):
        model = onnx.load(str(out / file))
        assert len(kernels.rewrite(model, kernel)) == 4, file  # q/k/v, o, gate/up, down
        assert not [n.name for n in model.graph.node if "/mins/" in n.name], file


# K-quants need rows of whole super-blocks (256); head_dim 16
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=4, head_dim=16,
               num_hidden_layers=1)


@pytest.mark.parametrize("matrices, weights", [("Q4_K", "int4"), ("Q5_K", "int8"), ("Q6_K", "int8")])
def test_a_k_quant_gguf_is_carried_exactly(tmp_path, monkeypatch, matrices, weights):
    path = _write(tmp_path, matrices, shape=K_SHAPE, monkeypatch=monkeypatch)
    out = tmp_path / "art"
    manifest = build(BuildOptions(model=str(path), out=str(out), progress=False, weights=weights), log=lambda *_: None)
    assert manifest.weights["from_gguf"] == {"carried": 5, "types": {matrices: 4, "Q8_0": 1}, "requantized": []}
    expected = _file_weights(path)
    for file in ("layer_00.onnx", "layer_00.gqa.onnx"):
        proto = onnx.load(str(out / file))
        blocks = {a.i for n in proto.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
        assert blocks == {16 if matrices == "Q6_K" else 32}
        used = split_fused(dequantized_weights(proto, onnx.load(str(out / "layer_00.onnx"))))
        for key, w in used.items():  # read back through int8 activations of an identity: to ~1e-5
            target = expected[f"model.layers.0.{key.removesuffix(TRANSPOSED)}"].T
            np.testing.assert_allclose(w, target, rtol=2e-5, atol=2e-7, err_msg=f"{file} {key}")


def test_a_q4_k_m_files_products_keep_its_own_widths_under_weights_auto(tmp_path, monkeypatch):
    """Q4_K_M: Q4_K matrices with a Q6_K v and ffn_down. --weights auto (the default) carries every
    product at the file's width, the fused q/k/v as a 4-bit product of q and k and an 8-bit one of
    v, concatenated: the float export's logits to float rounding where every product runs at float
    activations (deterministic=True); --weights int4 requantizes what is not 4-bit."""
    import runtime
    from tests.conftest import first_logits

    path = _write(tmp_path, "Q4_K", shape=K_SHAPE, monkeypatch=monkeypatch,
                  overrides={"attn_v": "Q6_K", "ffn_down": "Q6_K"})
    arts = {name: tmp_path / name for name in ("float", "auto", "int4")}
    for name, out in arts.items():
        build(BuildOptions(model=str(path), out=str(out), progress=False, check=False,
                           **({} if name == "auto" else {"weights": name})), log=lambda *_: None)
    auto = load_manifest(arts["auto"], check_hashes=False).weights
    assert auto["layers"] == "int4" and auto["from_gguf"] == {
        "carried": 5, "types": {"Q4_K": 2, "Q4_K+Q6_K": 1, "Q6_K": 1, "Q8_0": 1}, "requantized": []}
    assert load_manifest(arts["auto"], check_hashes=False).weights_label.endswith(
        "; the GGUF's blocks: 2 Q4_K, 1 Q4_K+Q6_K, 1 Q6_K, 1 Q8_0 products")  # what python -m runtime prints
    asked = load_manifest(arts["int4"], check_hashes=False).weights["from_gguf"]
    assert asked["types"] == {"Q4_K": 2, "Q8_0": 1} and len(asked["requantized"]) == 2
    for file in ("layer_00.onnx", "layer_00.gqa.onnx"):
        nodes = onnx.load(str(arts["auto"] / file)).graph.node
        widths = sorted((a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"))
        assert widths == [4, 4, 4, 8, 8] and sum(n.op_type == "Concat" and n.name.endswith("/concat")
                                                 for n in nodes) == 1, file
    prompts = ["the quick brown fox", "hello"]
    logits = {}
    for name, out in arts.items():
        with runtime.load(out, threads=1, deterministic=True) as gen:
            logits[name] = first_logits(gen, prompts)
    scale = np.abs(logits["float"]).max()
    assert np.abs(logits["auto"] - logits["float"]).max() < 1e-3 * scale < np.abs(logits["int4"] - logits["float"]).max()


def test_a_product_with_minimums_after_one_without_is_carried(tmp_path):
    """Q4_K_M's fallback for SmolLM2's widths: Q5_0 matrices (8 bits, no minimums) and a Q4_1 one,
    whose minimums' term needs x's rank after the graph already holds MatMulNBits nodes."""
    path = _write(tmp_path, "Q5_0", overrides={"ffn_down": "Q4_1"})
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert manifest.weights["from_gguf"]["types"] == {"Q5_0": 3 * SHAPE["num_hidden_layers"],
                                                      "Q4_1": SHAPE["num_hidden_layers"], "Q8_0": 1}


def test_products_this_projects_kernel_does_not_take_run_at_int8_activations_unless_deterministic(
        tmp_path, monkeypatch):
    """A Q6_K file's blocks of 16 stay on MatMulNBits beside this project's kernel, whose float path
    at 8 bits is a fallback ~20x-40x slower: they run at int8 activations, and say so, unless
    deterministic=True keeps them at float ones (the float export's logits, to float rounding)."""
    import runtime
    from runtime.platform import kernels
    from tests.conftest import first_logits

    if kernels.why_not() is not None:
        pytest.skip(f"runtime.platform.kernels cannot run here: {kernels.why_not()}")
    path = _write(tmp_path, "Q6_K", shape=K_SHAPE, monkeypatch=monkeypatch)
    for name, weights in (("float", "float"), ("int8", "int8")):
        build(BuildOptions(model=str(path), out=str(tmp_path / name), progress=False, check=False, weights=weights),
              log=lambda *_: None)
    prompts = ["the quick brown fox", "hello"]

    def logits(name, **options):
        with runtime.load(tmp_path / name, threads=1, **options) as gen:
            return first_logits(gen, prompts), gen.backend.int4_kernel_note
    exact, _ = logits("float")
    fast, note = logits("int8")
    assert note.endswith("; 4 products exported at float activations run at int8 ones on MatMulNBits, whose float "
                         "path is 1.2x-40x slower (deterministic=True keeps them: greedy text independent of the "
                         "batch)"), note
    kept, note = logits("int8", deterministic=True)
    assert "MatMulNBits" not in note
    scale = np.abs(exact).max()
    assert np.abs(kept - exact).max() < 1e-4 * scale < np.abs(fast - exact).max()


def test_a_carried_artifact_generates_on_either_kernel(tmp_path):
    """The runtime loads what export wrote from a GGUF's blocks (its manifest's from_gguf entry,
    a dict among the weights' strings, too) and generates on this project's kernel and on
    MatMulNBits (tests/runtime/test_kernels.py compares their products)."""
    import runtime

    path = _write(tmp_path, "Q4_1")
    out = tmp_path / "art"
    build(BuildOptions(model=str(path), out=str(out), progress=False, weights="int4", check=False),
          log=lambda *_: None)
    texts = {}
    for kernel in ("auto", "onnxruntime"):
        gen = runtime.load(out, threads=1, int4_kernel=kernel)
        try:
            texts[kernel] = gen.generate(["the quick brown fox"], 6, ignore_eos=True).token_ids[0]
        finally:
            gen.close()
    assert len(texts["auto"]) == len(texts["onnxruntime"]) == 6


def _levels(directory) -> dict[str, set[int]]:
    """Each graph's MatMulNBits accuracy levels."""
    return {f.name: {a.i for n in onnx.load(str(f), load_external_data=False).graph.node
                     if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
            for f in sorted(directory.glob("*.onnx"))}


def test_the_files_products_run_at_float_activations_and_give_the_float_exports_logits(tmp_path):
    """A carried product is the file's values exactly, so its activations are what is left: they
    are written at float activations (accuracy level 1), which this project's kernel computes at 16
    bits, so the int4 export of a Q4_1 file gives the float export's first logits to ~2e-4 of their
    scale, where int8 activations (--accuracy-level 4) leave ~4e-2. MatMulNBits (its float path ~9x
    slower) runs them at int8 activations and says so, unless deterministic=True, which also
    runs an --accuracy-level 4 export at float activations."""
    import runtime
    from runtime.platform import kernels
    from tests.conftest import first_logits

    path = _write(tmp_path, "Q4_1")
    lines, arts = [], {}
    for name, options in (("float", dict(weights="float")), ("int4", {}), ("int4-a8", dict(accuracy_level=4))):
        arts[name] = tmp_path / name
        build(BuildOptions(model=str(path), out=str(arts[name]), progress=False, check=False, **options), log=lines.append)
    assert {lv for levels in _levels(arts["int4"]).values() for lv in levels} == {1}
    assert {lv for levels in _levels(arts["int4-a8"]).values() for lv in levels} == {4}
    assert any(line.endswith("(block 32, matmulnbits); float activations: greedy text the same in any batch "
                             "(--accuracy-level 4: int8 ones, prompts faster)") for line in lines)
    prompts = ["the quick brown fox", "hello"]

    def logits(name, **options):
        with runtime.load(arts[name], threads=1, **options) as gen:
            return first_logits(gen, prompts), gen.backend
    exact, _ = logits("float")
    runs = {name: logits(name) for name in ("int4", "int4-a8")}
    error = {name: np.abs(got - exact).max() / np.abs(exact).max() for name, (got, _) in runs.items()}
    if kernels.why_not() is None:
        assert error["int4"] < 1e-3 and error["int4-a8"] > 50 * error["int4"], error
        assert runs["int4"][1].int4_kernel_note == "9 of its 9 products at float activations, computed at 16 bits"
        assert runs["int4-a8"][1].int4_kernel_note == ""
        # deterministic=True: an export at int8 activations computed at 16 bits all the same
        widened, backend = logits("int4-a8", deterministic=True)
        assert np.array_equal(widened, runs["int4"][0])
        assert backend.int4_kernel_note == "9 of its 9 products at float activations, computed at 16 bits"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "library", lambda: (None, "this CPU lacks avx2"))
        narrowed, backend = logits("int4")
        assert backend.int4_kernel == "onnxruntime" and backend.int4_kernel_note == (
            "runtime/platform/kernels cannot run here: this CPU lacks avx2; 9 products exported at float activations "
            "run at int8 ones on MatMulNBits, whose float path is 1.2x-40x slower (deterministic=True keeps them: "
            "greedy text independent of the batch)")
        assert np.array_equal(narrowed, logits("int4-a8")[0])  # the same graphs as exported at int8 activations
    # asked for by name, MatMulNBits runs them at int8 activations too; deterministic=True at float ones
    assert np.array_equal(logits("int4", int4_kernel="onnxruntime")[0], narrowed)
    exact_on_ort, backend = logits("int4-a8", int4_kernel="onnxruntime", deterministic=True)
    assert backend.int4_kernel_note.endswith("deterministic: 9 products exported at int8 activations run at float "
                                             "ones on MatMulNBits (1.2x-40x slower)")
    assert np.abs(exact_on_ort - exact).max() < 1e-4 * np.abs(exact).max()


def test_a_float_exports_draft_copies_are_the_files_own_blocks(tmp_path):
    """A float export of a quantized GGUF writes lossless drafts' copies (--draft-layers int4,
    --draft-head int8) from the file's own blocks, at float activations: drafts that multiply by
    exactly what the float layers do, so that they agree with them nearly always. The float graphs
    and the embedding stay float, and the manifest lists no carried weights of its own."""
    path = _write(tmp_path, "Q4_1")
    out = tmp_path / "art"
    manifest = build(BuildOptions(model=str(path), out=str(out), progress=False, check=False, weights="float",
                                  draft_layers="int4", draft_head="int8"), log=lambda *_: None)
    assert "from_gguf" not in manifest.weights and "block" not in manifest.embed_table  # a float table
    expected, levels = _file_weights(path), _levels(out)
    for i in range(SHAPE["num_hidden_layers"]):
        draft = onnx.load(str(out / f"layer_{i:02d}.draft.onnx"))
        assert levels[f"layer_{i:02d}.draft.onnx"] == {1}
        used = split_fused(dequantized_weights(draft, onnx.load(str(out / f"layer_{i:02d}.onnx"))))
        assert len(used) == 7
        for key, w in used.items():
            target = expected[f"model.layers.{i}.{key.removesuffix(TRANSPOSED)}"].T
            np.testing.assert_allclose(w, target, rtol=2e-6, atol=1e-7, err_msg=f"draft {i} {key}")
    assert levels["head_draft.onnx"] == {1}


@pytest.mark.parametrize("matrices, drafts", [("Q4_1", "int4"), ("Q8_0", "int8")])
def test_a_float_export_drafts_losslessly_on_the_files_blocks(tmp_path, matrices, drafts):
    """A float export of a quantized GGUF (--weights float) drafts through the file's own blocks
    by default (a 4-bit file's at int4), which the runtime runs on this project's kernel: lossless
    rows at speedup 1 (the manifest's default for a model never fine-tuned under SkipDecode) keep
    nearly every draft and give full depth's tokens."""
    import runtime
    from runtime.platform import kernels

    path = _write(tmp_path, matrices)
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, check=False,
                                  weights="float"), log=lambda *_: None)
    assert manifest.weights == {"head_draft": "int8", "layers_draft": drafts}
    with runtime.load(tmp_path / "art", threads=1) as gen:
        if kernels.why_not() is None:  # the layers' 4 products each and the head's copy, packed
            assert len(gen.backend._q4_handles) == 4 * SHAPE["num_hidden_layers"] + 1
        prompts = ["the quick brown fox", "hello there"]
        want = gen.generate(prompts, 24, ignore_eos=True)
        got = gen.generate(prompts, 24, lossless=True, ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert got.stats.acceptance_rate >= 0.9, got.stats.acceptance_rate


@pytest.mark.parametrize("weights, requantize", [("int4", False), ("int4", True), ("int8", True)])
def test_a_quantized_exports_lossless_rows_give_full_depths_tokens_alone(tmp_path, weights, requantize):
    """Issue 55: an int4/int8 artifact's lossless tokens must be its full depth's, in any batch. A
    verify pass's T-token attention rounds differently from T single steps (~1e-6); int8
    activations turned that into other tokens (this model: 1 of 4 rows full depth's at speedup 1,
    the real SmolLM2 1 of 16); at the float activations every product is exported at (the file's
    blocks and requantized ones alike), 16-bit on this project's kernel, every row is full depth's
    alone."""
    import runtime
    from runtime.platform import kernels

    if kernels.why_not() is not None:
        pytest.skip(f"runtime.platform.kernels cannot run here: {kernels.why_not()}")
    path = _write(tmp_path, "Q4_1")
    build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, check=False, weights=weights,
                       requantize=requantize), log=lambda *_: None)
    prompts = ["the quick brown fox", "hello there", "a b c d e f g", "one two three four five six seven eight"]
    with runtime.load(tmp_path / "art", threads=1) as gen:
        alone = [gen.generate([p], 32, ignore_eos=True).token_ids[0] for p in prompts]
        assert gen.generate(prompts, 32, ignore_eos=True).token_ids == alone
        for speedup in (1, 2):
            got = gen.generate(prompts, 32, lossless=True, speedup=speedup, ignore_eos=True)
            assert got.token_ids == alone, speedup
            assert got.stats.verify_passes > 0


@pytest.mark.parametrize("matrices, layers, head", [("Q4_1", "int4", "int8"), ("Q8_0", "int8", "int8"),
                                                    ("F32", "float", "float")])
def test_weights_auto_keeps_the_files_precision(tmp_path, matrices, layers, head):
    """--weights auto, the default: a quantized GGUF's own precision (its blocks carried), a float
    one's float."""
    from export.__main__ import main as export_main

    path = _write(tmp_path, matrices, embedding="F32" if matrices == "F32" else "Q8_0")
    lines = []
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, check=False),
                     log=lines.append)
    assert (manifest.weights.get("layers", "float"), manifest.weights.get("head", "float")) == (layers, head)
    assert f"--weights auto: {layers} (the file's {matrices} layers)" in lines
    if layers != "float":
        assert manifest.weights["from_gguf"]["requantized"] == []
    assert export_main(["build", "--model", str(path), "--out", str(tmp_path / "cli"), "-q", "--no-check"]) == 0
    assert load_manifest(tmp_path / "cli", check_hashes=False).weights == manifest.weights


def test_weights_auto_of_a_checkpoint_is_float(tmp_path):
    from tests.families import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "llama3")
    lines = []
    manifest = build(BuildOptions(model=str(ckpt), out=str(tmp_path / "art"), progress=False, check=False,
                                  weights="auto"), log=lines.append)
    assert not manifest.quantized and lines[0].startswith("--weights auto: float (")
    assert lines[0].endswith("holds no quantized blocks)")


def test_requantizing_moves_the_weights_carrying_keeps_them(tmp_path):
    """Why carry: the same Q4_1 file exported with --block-size 16 (not GGML's 32) is requantized,
    and its weights move away from the file's values."""
    path = _write(tmp_path, "Q4_1")
    lines = []
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, weights="int4",
                                  block_size=16, check=False), log=lines.append)
    assert manifest.weights["from_gguf"]["carried"] == 0
    assert any("--block-size is not the file's 32" in line for line in lines)
    used = split_fused(dequantized_weights(onnx.load(str(tmp_path / "art" / "layer_00.onnx"))))
    target = _file_weights(path)["model.layers.0.self_attn.q_proj.weight"].T
    assert np.abs(used["self_attn.q_proj.weight.T"] - target).max() > 1e-3


def test_an_int4_head_asked_for_is_requantized_from_the_q8_0_file(tmp_path):
    path = _write(tmp_path, "Q4_0")
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, weights="int4",
                                  head_weights="int4", check=False), log=lambda *_: None)
    assert manifest.weights["head"] == "int4"
    assert manifest.weights["from_gguf"]["requantized"] == ["lm_head.weight.T"]
    levels = _levels(tmp_path / "art")  # carried and requantized alike: float activations
    assert levels["head.onnx"] == {1} and levels["layer_00.gqa.onnx"] == {1}


def test_requantize_leaves_the_files_blocks(tmp_path):
    from export.__main__ import main as export_main

    path = _write(tmp_path, "Q4_1")
    assert export_main(["build", "--model", str(path), "--out", str(tmp_path / "art"), "-q", "--weights", "int4",
                        "--requantize", "--no-check"]) == 0
    weights = json.loads((tmp_path / "art" / "manifest.json").read_text())["weights"]
    assert "from_gguf" not in weights and weights["head"] == "int4"


def test_a_float_gguf_has_nothing_to_carry(tmp_path):
    path = _write(tmp_path, "F32", embedding="F32")
    assert not BlockIndex.from_gguf(path)
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, weights="int4",
                                  check=False), log=lambda *_: None)
    assert "from_gguf" not in manifest.weights


def _initializers(path) -> dict[str, tuple[list, int | None]]:
    """A graph's initializers: name -> (dims, offset in the shared file, None inside the graph)."""
    proto = onnx.load(str(path), load_external_data=False)
    return {t.name: (list(t.dims), next((int(e.value) for e in t.external_data if e.key == "offset"), None))
            for t in proto.graph.initializer}


@pytest.mark.parametrize("matrices, weights", [("Q4_1", "int4"), ("Q8_0", "int8")])
def test_a_q8_0_embedding_is_gathered_from_the_heads_own_blocks(tmp_path, matrices, weights):
    """The file's Q8_0 embedding (tied to the head) is not written as float: the embedding graph
    gathers the head's 8-bit blocks and scales, stored once, and gives the float table's values
    bit for bit, as the runtime's lookup of them does."""
    import onnxruntime as ort

    import runtime

    path = _write(tmp_path, matrices, shape={**SHAPE, "tie_word_embeddings": True})  # SmolLM2's are tied
    out = tmp_path / "art"
    lines = []
    manifest = build(BuildOptions(model=str(path), out=str(out), progress=False, weights=weights), log=lines.append)
    table = _file_weights(path)["model.embed_tokens.weight"]  # (V, D) what the float export holds
    V, D = table.shape
    assert manifest.weights["embed"] == "int8"
    assert any(line.endswith("the embedding gathered from its 8-bit blocks") for line in lines)
    embed, head = _initializers(out / "embed.onnx"), _initializers(out / "head.onnx")
    assert not [n for n, (dims, _) in embed.items() if dims == [V, D]]  # no float table
    shared = {offset for dims, offset in embed.values() if offset is not None}
    assert shared == {offset for dims, offset in head.values() if dims in ([V, D // 32, 32], [V * D // 32])}
    assert manifest.embed_table == {"file": "weights.bin", "offset": head["lm_head.weight.T_Q8"][1], "shape": [V, D],
                                    "block": 32, "scales": head["lm_head.weight.T_scales"][1]}
    ids = np.arange(V, dtype=np.int64)[None]  # (1, V): every row
    graph = ort.InferenceSession(str(out / "embed.onnx"), providers=["CPUExecutionProvider"])
    assert np.array_equal(graph.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0], table)
    gen = runtime.load(out, threads=1)
    try:
        assert np.array_equal(gen.engine.backend.embed(ids, np.ones_like(ids))[0], table)
        assert ", int8 embed; the GGUF's blocks: " in gen.manifest.weights_label
    finally:
        gen.close()


def test_an_embedding_with_minimums_is_gathered_exactly(tmp_path, monkeypatch):
    """Q5_K blocks (d * q + m): the graph and the lookup add the minimums."""
    import runtime

    path = _write(tmp_path, "Q5_K", embedding="Q5_K", shape=K_SHAPE, monkeypatch=monkeypatch)
    out = tmp_path / "art"
    manifest = build(BuildOptions(model=str(path), out=str(out), progress=False, weights="int8"), log=lambda *_: None)
    assert set(manifest.embed_table) == {"file", "offset", "shape", "block", "scales", "minimums"}
    table = _file_weights(path)["model.embed_tokens.weight"]
    ids = np.arange(table.shape[0], dtype=np.int64).reshape(4, -1)  # (4, V / 4)
    gen = runtime.load(out, threads=1)
    try:
        assert np.array_equal(gen.engine.backend.embed(ids, np.ones_like(ids)), table.reshape(4, -1, table.shape[1]))
    finally:
        gen.close()


def test_a_4_bit_embedding_stays_float(tmp_path):
    path = _write(tmp_path, "Q4_0", embedding="Q4_0")
    lines = []
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False, weights="int4",
                                  check=False), log=lines.append)
    assert manifest.weights["embed"] == "float" and "block" not in manifest.embed_table
    assert any(line.endswith("the embedding float (the file holds it in no 8-bit type)") for line in lines)


def test_a_gathered_embedding_generates_what_its_graph_gives(tmp_path):
    """The lookup and the graph it stands in for (the entry removed: as an artifact before it)
    give the same tokens; an entry whose scales lie past the file is refused."""
    import shutil

    import runtime
    from runtime.errors import ArtifactError

    path = _write(tmp_path, "Q4_1")
    out = tmp_path / "art"
    build(BuildOptions(model=str(path), out=str(out), progress=False, weights="int4", check=False),
          log=lambda *_: None)
    variants = {}
    for name, change in (("graph", lambda e: None), ("broken", lambda e: e.update(scales=10**8))):
        copy = tmp_path / name
        shutil.copytree(out, copy)
        m = json.loads((copy / "manifest.json").read_text())
        if name == "graph":
            del m["embed_table"]
        else:
            change(m["embed_table"])
        (copy / "manifest.json").write_text(json.dumps(m))
        variants[name] = copy
    with pytest.raises(ArtifactError, match="embed_table's scales ends at byte 100"):
        runtime.load(variants["broken"])
    tokens = {}
    for name, where in (("lookup", out), ("graph", variants["graph"])):
        gen = runtime.load(where, threads=1)
        try:
            assert ("embed" in gen.engine.backend._sessions) == (name == "graph")
            tokens[name] = gen.generate(["the quick brown fox", "a"], 8, ignore_eos=True).token_ids
        finally:
            gen.close()
    assert tokens["lookup"] == tokens["graph"]
