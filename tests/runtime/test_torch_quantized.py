"""The torch backend over int4 / int8 artifacts (issue 54 part 2): each product multiplied by the
artifact's own MatMulNBits blocks (runtime.models.quantized), never by a float copy of its weight,
token- and logit-equal to the ONNX Runtime backend at float activations; the Triton kernel a GPU
runs, checked on the CPU under Triton's interpreter."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

import runtime
from export.build import BuildOptions, build
from export.quantize import dequantized_weights
from runtime.backends.cuda_graphs import EagerCapture
from runtime.errors import ArtifactError
from runtime.models import quantized
from runtime.models.quantized import Blocks, QuantLinear, read_products
from pathlib import Path

from tests import conftest, families

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = ["hello there", "a b c d e f", "the quick brown fox jumps"]
NEW = 8
# (family, checkpoint overrides, weights): OPT (biases everywhere), Qwen2.5 (q/k/v bias fused with its
# products, 8 bits), Llama 3.2 (tied embeddings: the head's product quantized, the table float);
# widths that are whole blocks of 16
# and a GGUF's own blocks carried (Q4_1: zero points 0 and a minimums' term; its Q8_0 embedding table
# looked up as 8-bit rows), what the default build of smollm2-135m-instruct holds
CASES = {
    "opt-int4": ("opt", {}, "int4"),
    "qwen2-int8": ("qwen2", dict(hidden_size=48, intermediate_size=64), "int8"),
    "llama3-int4": ("llama3", dict(hidden_size=48, intermediate_size=64), "int4"),
    "gguf-q4_1": ("gguf", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, num_hidden_layers=2), "int4"),
}


def _checkpoint(directory, family: str, overrides: dict):
    if family == "opt":
        return conftest.save_tiny_checkpoint(directory, "pre_ln", **overrides)
    if family == "gguf":
        from export.checkpoint import build_tokenizer
        from tools.bench.gguf_file import write_checkpoint_gguf

        return write_checkpoint_gguf(families.tiny_model("smollm2", **overrides), build_tokenizer(),
                                     directory / "Q4_1.gguf", matrices="Q4_1", embedding="Q8_0")
    return families.save_tiny_checkpoint(directory, family, **overrides)


@pytest.fixture(scope="module", params=list(CASES))
def quantized_dir(request, tmp_path_factory):
    family, overrides, weights = CASES[request.param]
    ckpt = _checkpoint(tmp_path_factory.mktemp(f"{request.param}-ckpt"), family, overrides)
    out = tmp_path_factory.mktemp(request.param) / "model"
    block = 32 if family == "gguf" else 16  # a GGUF's blocks are 32 wide
    build(BuildOptions(model=str(ckpt), out=str(out), weights=weights, block_size=block, progress=False),
          log=lambda *_: None)
    return out


def _steps(gen, **kwargs):
    events = []
    result = gen.generate(PROMPTS, NEW, ignore_eos=True, streamer=events.append, **kwargs)
    return result.token_ids, events


def assert_same_steps(ours, theirs, atol: float) -> None:
    """The same tokens at full depth and 2x, and every step's logits within ``atol``; both closed after."""
    try:
        for speedup in (1, 2):
            (got, got_events), (want, want_events) = _steps(ours, speedup=speedup), _steps(theirs, speedup=speedup)
            assert got == want, f"speedup {speedup}"
            for step, (a, b) in enumerate(zip(got_events, want_events)):
                np.testing.assert_allclose(a.logits, b.logits, atol=atol, rtol=0, err_msg=f"step {step}")
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("static", [False, True], ids=["layers", "static-step"])
def test_tokens_and_logits_equal_onnxruntime_at_float_activations(quantized_dir, static):
    # deterministic: ONNX Runtime's own MatMulNBits at float activations, what the blocks mean exactly
    ort = runtime.load(quantized_dir, threads=1, int4_kernel="onnxruntime", deterministic=True)
    gen = runtime.load(quantized_dir, backend="torch")
    if static:
        gen.engine.backend.use_graphs(EagerCapture())  # the step a CUDA graph captures, run eagerly
    assert_same_steps(gen, ort, atol=1e-4)


NO_CUDA = "no CUDA device visible to PyTorch on this machine; the Triton kernel runs on a GPU (or its interpreter)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_the_triton_kernel_on_cuda_equals_the_cpu_path(quantized_dir, cuda_graphs):
    """On a GPU: the kernel itself (float32 artifact, so IEEE products), eager and in CUDA graphs."""
    gpu = runtime.load(quantized_dir, backend="torch", device="cuda", cuda_graphs=cuda_graphs)
    assert_same_steps(gpu, runtime.load(quantized_dir, backend="torch"), atol=1e-3)


def test_every_product_is_held_in_its_blocks(quantized_dir):
    gen = runtime.load(quantized_dir, backend="torch")
    try:
        model = gen.engine.backend.hf_model
        products = [m for m in model.modules() if isinstance(m, QuantLinear)]
        linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert not linears, f"products left float: {linears}"
        from_gguf = "from_gguf" in json.loads((quantized_dir / "manifest.json").read_text())["weights"]
        tables = [m for m in model.modules() if isinstance(m, quantized.QuantEmbedding)]
        assert len(tables) == from_gguf  # the file's 8-bit embedding: rows dequantized as looked up
        assert all(m.mins is not None for m in products[:-1]) == from_gguf  # Q4_1's minimums
        layers = model.config.num_hidden_layers
        assert len(products) == layers * (6 if model.config.model_type == "opt" else 7) + 1  # + the head
        bits = json.loads((quantized_dir / "manifest.json").read_text())["weights"]["layers"]
        for m in products[:-1]:  # the layers' (a GGUF's head is its 8-bit table)
            assert m.packed.dtype == torch.uint8
            assert m.packed.numel() == m.out_features * m.in_features * {"int4": 4, "int8": 8}[bits] // 8
    finally:
        gen.close()


def test_blocks_are_the_weights_onnxruntime_multiplies_by(quantized_dir):
    proto = onnx.load(str(quantized_dir / "layer_01.onnx"))
    found = read_products(proto)
    reference = dequantized_weights(proto)  # ONNX Runtime's own MatMulNBits (and minimums' term) on an identity
    assert sorted(found) == sorted(name.removesuffix(".T") for name in reference)
    for name, blocks in found.items():
        np.testing.assert_allclose(blocks.dequantize(), reference[name + ".T"].T, atol=1e-6, rtol=0, err_msg=name)


def test_the_cpu_path_dequantizes_a_slice_at_a_time(monkeypatch):
    rng = np.random.default_rng(0)
    N, K, block = 40, 64, 16
    blocks = Blocks(rng.integers(0, 256, (N, K // 2), dtype=np.uint8), rng.random((N, K // block), np.float32),
                    rng.integers(0, 16, (N, K // block), dtype=np.uint8), 4, block)
    product = QuantLinear.from_blocks(blocks, torch.randn(N), "cpu", torch.float32)
    x = torch.randn(3, 2, K)
    expected = x.double() @ torch.from_numpy(blocks.dequantize()).double().T + product.bias.double()
    sizes = []
    rows = QuantLinear.weight_rows
    monkeypatch.setattr(quantized, "CPU_SLICE", 7 * K)  # 7 output columns at a time
    monkeypatch.setattr(QuantLinear, "weight_rows", lambda self, a, b: sizes.append(b - a) or rows(self, a, b))
    torch.testing.assert_close(product(x).double(), expected, atol=1e-4, rtol=1e-6)
    assert sizes == [7] * 5 + [5]


def test_fused_products_share_their_parts_memory():
    rng = np.random.default_rng(1)
    parts = [QuantLinear.from_blocks(Blocks(rng.integers(0, 256, (n, 16), dtype=np.uint8), rng.random((n, 2), np.float32),
                                rng.integers(0, 16, (n, 2), dtype=np.uint8), 4, 16), None, "cpu", torch.float32)
             for n in (8, 4, 4)]
    x = torch.randn(2, 32)
    apart = torch.cat([p(x) for p in parts], dim=-1)
    fused = QuantLinear.fused(parts)
    torch.testing.assert_close(fused(x), apart)
    assert parts[1].packed.data_ptr() == fused.packed.data_ptr() + 8 * 16  # a view, not a copy
    with pytest.raises(ValueError, match="one bit width, block size and input width"):
        QuantLinear.fused([parts[0], QuantLinear.from_blocks(Blocks(np.zeros((4, 32), np.uint8), np.ones((4, 2), np.float32),
                                                        np.zeros((4, 2), np.uint8), 8, 16), None, "cpu", torch.float32)])


def test_a_qdq_artifact_is_refused_with_the_fix(tmp_path):
    ckpt = conftest.save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln")
    out = tmp_path / "qdq"
    build(BuildOptions(model=str(ckpt), out=str(out), weights="int4", block_size=16, weights_format="qdq",
                       progress=False), log=lambda *_: None)
    with pytest.raises(ArtifactError, match="the qdq format, for TensorRT.*re-export with --quant-format "
                                            "matmulnbits, or use the onnxruntime backend"):
        runtime.load(out, backend="torch")


TRITON_RUN = """
import sys, numpy as np, runtime
gen = runtime.load(sys.argv[1], backend="torch")
events = []
result = gen.generate({prompts!r}, {new}, ignore_eos=True, speedup=2, streamer=events.append)
np.save(sys.argv[2], np.stack([e.logits for e in events]))
assert "runtime.models.quantized_triton" in sys.modules  # the kernel ran, not the CPU path
print(result.token_ids)
"""


def test_the_triton_kernel_under_its_interpreter_equals_the_cpu_path(quantized_dir, tmp_path):
    """What a GPU runs (runtime.models.quantized_triton), on the CPU: Triton's interpreter, which must be
    on before Triton is imported, so in a process of its own."""
    pytest.importorskip("triton")
    gen = runtime.load(quantized_dir, backend="torch")
    try:
        tokens, events = _steps(gen, speedup=2)
    finally:
        gen.close()
    code = TRITON_RUN.format(prompts=PROMPTS, new=NEW)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(quantized_dir), str(tmp_path / "logits.npy")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(tokens)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), np.stack([e.logits for e in events]),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits, weights", [(4, "int4"), (8, "int8")])
def test_quantize_makes_the_blocks_onnx_runtimes_quantizer_makes(bits, weights):
    """What tools.bench.gpu --weights int4 runs at real shapes (random weights, no export) is what an
    export of the same weights would hold."""
    from onnx import TensorProto, helper, numpy_helper

    from export.quantize import quantize_graph

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24, bias=False)
    with torch.no_grad():
        linear.weight[:2] *= 5
        linear.weight[3] = linear.weight[3].abs()  # a block of one sign: 0 is still in its range
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24])],
                              [numpy_helper.from_array(linear.weight.detach().numpy().T.copy(), "w")])
    exported = read_products(quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                            weights, block_size=16))["w"]
    ours = QuantLinear.quantize(linear, bits, 16)
    np.testing.assert_array_equal(ours.packed.numpy(), exported.packed)
    np.testing.assert_array_equal(ours.zeros.numpy(), exported.zeros)
    np.testing.assert_array_equal(ours.scales.numpy(), exported.scales)


KERNELS_RUN = """
import numpy as np, torch
from runtime.models.quantized import Blocks, QuantLinear
from runtime.models import quantized_triton as kernels
rng = np.random.default_rng(0)
N, K = 70, 320  # neither a whole number of any tile's columns nor of its codes
worst = {{}}
for bits, block, mins, dtype in {cases!r}:
    dtype = getattr(torch, dtype)
    blocks = Blocks(rng.integers(0, 256, (N, K * bits // 8), dtype=np.uint8),
                    rng.random((N, K // block), np.float32) * 0.1,
                    rng.integers(0, 1 << bits, (N, K // block), dtype=np.uint8), bits, block,
                    (rng.random((N, K // block), np.float32) - 0.5) if mins else None)
    product = QuantLinear.from_blocks(blocks, None, "cpu", dtype)
    weight = torch.from_numpy(blocks.dequantize()).double()
    for M in (1, 3, 20):  # one row and three: qmv; twenty: the tensor cores' tile
        x = torch.randn(M, K).to(dtype)
        expected = x.double() @ weight.T
        for tile in ({{"BN": 16, "BK": 128}}, {{"BN": 8, "BK": 256}}, {{"BN": 32, "BK": 512}}):
            kernels.GEMV_TILE = tile
            error = ((kernels.matmul(x, product).double() - expected).abs().max() / expected.abs().max()).item()
            key = (bits, block, mins, str(dtype), M <= kernels.GEMV_ROWS)
            worst[key] = max(worst.get(key, 0.0), error)
print(worst)
"""


def test_the_decode_kernel_under_its_interpreter_equals_the_dequantized_product(tmp_path):
    """qmv (a decode step's few rows) and qmm (more rows) against x @ w.T in float64, w the blocks
    dequantized: 4 and 8 bits, blocks of 16-64, GGUF minimums or none, fp32 and fp16 activations, tiles
    that do not divide the product (the autotuner's candidates on a GPU)."""
    pytest.importorskip("triton")
    cases = [(4, 16, False, "float32"), (4, 32, True, "float32"), (4, 64, False, "float16"),
             (8, 32, False, "float32"), (8, 16, True, "float16")]
    done = subprocess.run([sys.executable, "-c", KERNELS_RUN.format(cases=cases)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = eval(done.stdout.strip().splitlines()[-1])  # {(bits, block, mins, dtype, qmv): relative error}
    assert {key[-1] for key in worst} == {True, False}
    for (bits, block, mins, dtype, _), error in worst.items():
        assert error < (1e-6 if dtype == "torch.float32" else 2e-3), (bits, block, mins, dtype, error)
