"""tinygemm (PyTorch's own int4 product) over an artifact's blocks, the torch backend's
``int4_kernel="tinygemm"`` (runtime.models.quantized_tinygemm): the product the blocks stand for, a
fused product's parts held once, the products it cannot take left on the blocks, and the tokens and
logits of ONNX Runtime's MatMulNBits. On the CPU its CPU twin runs; the CUDA test runs on a GPU."""

import re

import pytest
import torch

import runtime
from export.build import BuildOptions, build
from runtime.backends.cuda_graphs import EagerCapture
from runtime.errors import InvalidArgumentError
from runtime.models.quantized import QuantLinear
from runtime.models.quantized_tinygemm import Int4PackLinear, Stacked, fits
from runtime.models.step import fuse_linears
from tests.runtime.test_torch_quantized import _checkpoint, assert_same_steps

# tinygemm takes blocks of 32 or more: a GGUF's own Q4_1 blocks (zero points and minimums), and a Llama
# 3.2 export at blocks of 32 (its head quantized: 8 of its widths are not whole tiles, so some products
# stay on the blocks)
CASES = {
    "gguf-q4_1": ("gguf", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, num_hidden_layers=2)),
    "llama3-int4": ("llama3", dict(hidden_size=64, intermediate_size=96)),
}


@pytest.fixture(scope="module", params=list(CASES))
def int4_dir(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    ckpt = _checkpoint(tmp_path_factory.mktemp(f"{request.param}-ckpt"), family, overrides)
    out = tmp_path_factory.mktemp(request.param) / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), weights="int4", block_size=32, progress=False),
          log=lambda *_: None)
    return out


def _blocks(out_features: int, in_features: int = 96, mins: bool = False, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    q = QuantLinear.quantize(torch.nn.Linear(in_features, out_features), 4, 32)
    if mins:  # a GGUF's term: w = (q - z) * s + m
        q.mins = torch.randn_like(q.scales) * 0.01
    return q


def _product(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    return x @ q.weight_rows(0, q.out_features).T + q.bias  # (M, N): what the blocks stand for


@pytest.mark.parametrize("mins", [False, True])
def test_the_pack_multiplies_by_what_the_blocks_stand_for(mins):
    q = _blocks(64, mins=mins)
    x = torch.randn(5, 96)
    torch.testing.assert_close(Int4PackLinear.from_quant(q)(x), _product(q, x), atol=1e-5, rtol=0)
    assert Int4PackLinear.from_quant(q)(x[None]).shape == (1, 5, 64)  # any leading shape


def test_a_fused_product_holds_its_parts_once_where_they_are_whole_blocks():
    parts = [_blocks(n, seed=n) for n in (128, 64, 64)]  # CPU layout blocks of 64 columns
    x = torch.randn(3, 96)
    want = [_product(p, x) for p in parts]
    packs = [Int4PackLinear.from_quant(p) for p in parts]
    fused, bias = fuse_linears(*packs)
    assert isinstance(fused, Int4PackLinear) and bias is None  # the bias inside
    torch.testing.assert_close(fused(x), torch.cat(want, -1), atol=1e-5, rtol=0)
    start = fused.pack.data_ptr()
    row = fused.pack.stride(0) * fused.pack.element_size()
    assert [p.pack.data_ptr() for p in packs] == [start, start + 128 * row, start + 192 * row]  # views
    for p, w in zip(packs, want):  # and the parts still multiply by their own
        torch.testing.assert_close(p(x), w, atol=1e-5, rtol=0)


def test_parts_that_are_not_whole_blocks_run_one_after_the_other():
    parts = [Int4PackLinear.from_quant(_blocks(n, seed=n)) for n in (64, 32, 32)]  # k/v of 32 columns
    fused, bias = fuse_linears(*parts)
    assert isinstance(fused, Stacked) and bias is None and fused.out_features == 128
    x = torch.randn(2, 96)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1))
    mixed, _ = fuse_linears(parts[0], _blocks(32))  # one product it took, one it did not
    assert isinstance(mixed, Stacked)


@pytest.mark.parametrize("make, reason", [
    (lambda: QuantLinear.quantize(torch.nn.Linear(96, 64), 8, 32), "8-bit codes (tinygemm takes 4)"),
    (lambda: QuantLinear.quantize(torch.nn.Linear(96, 64), 4, 16), "blocks of 16 (tinygemm takes 32, 64, 128, 256)"),
    (lambda: QuantLinear.quantize(torch.nn.Linear(48, 64), 4, 16 * 3), "blocks of 48"),
    (lambda: _blocks(40), "N 40 is not a multiple of 16")])
def test_what_tinygemm_cannot_take_says_why(make, reason):
    assert fits(make()).startswith(reason)


@pytest.mark.parametrize("static", [False, True], ids=["layers", "static-step"])
def test_tokens_and_logits_equal_onnxruntime_at_float_activations(int4_dir, static):
    ort = runtime.load(int4_dir, threads=1, int4_kernel="onnxruntime", deterministic=True)
    gen = runtime.load(int4_dir, backend="torch", int4_kernel="tinygemm")
    assert re.match(r"[1-9]\d* products on tinygemm", gen.backend.int4_kernel_note), gen.backend.int4_kernel_note
    packs = [m for m in gen.backend.hf_model.modules() if isinstance(m, Int4PackLinear)]
    assert packs and not any(isinstance(m, QuantLinear) and fits(m) is None for m in gen.backend.hf_model.modules())
    if static:
        gen.engine.backend.use_graphs(EagerCapture())  # the fused products of the step a CUDA graph captures
    assert_same_steps(gen, ort, atol=1e-4)


def test_a_model_it_takes_nothing_of_says_so(artifact_dir):
    with pytest.warns(UserWarning, match=r"int4_kernel='tinygemm' takes none of this model's products \(it has no "
                                         r"int4 weights\): they run as with int4_kernel='auto'"):
        gen = runtime.load(artifact_dir, backend="torch", int4_kernel="tinygemm")
    assert gen.backend.int4_kernel is None
    gen.close()


def test_an_unknown_kernel_is_refused_naming_the_choices(int4_dir):
    with pytest.raises(InvalidArgumentError, match=r"int4_kernel='skipdecode': the torch backend takes 'auto' .* "
                                                   r"or 'tinygemm'") as info:
        runtime.load(int4_dir, backend="torch", int4_kernel="skipdecode")
    assert info.value.param == "int4_kernel"


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device visible to PyTorch on this machine; tinygemm's CUDA kernel runs on a GPU")
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_tinygemm_on_cuda_equals_the_cpu_path(int4_dir, cuda_graphs):
    """On a GPU: bfloat16 activations, scales and zero terms, so a looser tolerance; the same tokens."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tinygemm needs compute capability 8.0 or later")
    gpu = runtime.load(int4_dir, backend="torch", device="cuda", cuda_graphs=cuda_graphs, int4_kernel="tinygemm")
    assert_same_steps(gpu, runtime.load(int4_dir, backend="torch"), atol=3e-2)


def test_the_command_line_runs_it_and_says_so(int4_dir, capsys):
    from runtime.__main__ import main

    assert main([str(int4_dir), "hello there", "--backend", "torch", "--int4-kernel", "tinygemm",
                 "--max-new-tokens", "3", "--no-check-hashes"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^weights: .*; int4 products on PyTorch's int4 product \(tinygemm\) \([1-9]\d* products on "
                     r"tinygemm", err, re.M), err


def test_compiled_steps_run_it_too(int4_dir):
    """compile_steps=True: torch.compile (inductor) takes the product into the layer it compiles:
    the tokens and logits of the uncompiled static steps."""
    plain = runtime.load(int4_dir, backend="torch", int4_kernel="tinygemm", max_batch=2)
    compiled = runtime.load(int4_dir, backend="torch", int4_kernel="tinygemm", max_batch=2, compile_steps=True)
    for gen in (plain, compiled):
        gen.backend.use_graphs(EagerCapture())
    assert_same_steps(compiled, plain, atol=1e-4)


def test_backends_sharing_a_model_share_its_packs(recwarn):
    """tools.bench.gpu puts an eager and a graph backend over one model: the first repacks its blocks,
    the second finds them packed (no warning that it took nothing)."""
    from runtime.backends.torch import TorchBackend
    from tests.families import tiny_model
    from tools.bench.gpu import quantize_model

    model = tiny_model("llama3", hidden_size=64, intermediate_size=128)
    quantize_model(model, 4)
    first = TorchBackend.from_model(model, cuda_graphs=False, int4_kernel="tinygemm")
    second = TorchBackend.from_model(model, cuda_graphs=False, int4_kernel="tinygemm")
    assert first.int4_kernel_note.split(" products")[0] == second.int4_kernel_note.split(" products")[0] != "0"
    assert second.int4_kernel == "tinygemm" and not [w for w in recwarn if "tinygemm" in str(w.message)]
