"""The layer graphs export.onnx_export writes are lean (few nodes left after ONNX Runtime's own
optimizations) and equal to the PyTorch layer they are traced from, over the shapes a runtime binds."""

import numpy as np
import onnx
import pytest
import torch
from transformers import OPTForCausalLM

from export.onnx_export import ExportConfig, export_graph, graph_specs
from export.trt_compat import check_graph
from runtime.graph_ops import reshape
from runtime.models import skip_model
from tests.conftest import tiny_config
from tests.families import tiny_model

ort = pytest.importorskip("onnxruntime")

# Nodes of layer_00 after ONNX Runtime's level-ALL optimizations on the CPU provider. Before
# runtime.graph_ops the TorchScript exporter's shape arithmetic left OPT 70, Llama 3 117, SmolLM2 117,
# Qwen2 120 and Qwen3 119 (Shape/Gather/Unsqueeze/Concat per .view, Range-indexed Gathers for the
# probabilities' split and the positions, Range/LessOrEqual/And for the causal mask, Split/Neg/Concat
# for RoPE's rotate_half); then OPT 48 (10 MatMuls, 6 bias Adds, 2 LayerNorms, a Softmax, ...) and
# the Llama family 67-72; with q/k/v and gate/up each one MatMul and a Split
# (export.weights.fuse_sibling_matmuls), OPT 47 and the Llama family 66-71.
MAX_NODES = {"opt": 47, "llama3": 68, "smollm2": 66, "qwen2": 71, "qwen3": 68}
PAGE = 8


def _model(variant):
    if variant == "opt":
        torch.manual_seed(0)
        return skip_model(OPTForCausalLM(tiny_config("pre_ln")).eval())
    return skip_model(tiny_model(variant))


def _export(model, name, directory, opset=17):
    spec = next(s for s in graph_specs(model, "float32") if s.name == name)
    export_graph(model, spec, directory, ExportConfig(external_data="never", page_size=PAGE, opset=opset))
    return directory / spec.file


@pytest.fixture(scope="module", params=list(MAX_NODES))
def layer(request, tmp_path_factory):
    """(variant, model, exported layer_00 path)."""
    model = _model(request.param)
    return request.param, model, _export(model, "layer_00", tmp_path_factory.mktemp(request.param))


def _session(path, optimized=None):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # the optimized model's hardware-specific-nodes warning
    if optimized:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _optimized_ops(path, tmp_path):
    _session(path, tmp_path / "optimized.onnx")
    return [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]


def test_layer_graph_has_few_nodes_after_onnxruntime_optimizations(layer, tmp_path):
    variant, _, path = layer
    ops = _optimized_ops(path, tmp_path)
    assert len(ops) <= MAX_NODES[variant], sorted(ops)
    # no shape arithmetic of .view, no index ranges, no mask rebuilt from Ranges
    assert "Range" not in ops and "LessOrEqual" not in ops
    if variant == "opt":
        assert "Unsqueeze" not in ops


def test_sibling_projections_are_one_matmul_whose_parts_read_back_as_the_modules_weights(layer):
    """q/k/v (and Llama's gate/up) are one MatMul on concatenated weights, then a Split; the torch
    backend's reader gives back each module weight exactly."""
    from runtime.backends.torch import read_graph_weights

    variant, model, path = layer
    proto = onnx.load(str(path))
    inits = {t.name for t in proto.graph.initializer}
    products = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    assert len(products) == 4  # qkv, out, fc1 / gate+up, fc2 / down
    assert "q_proj.weight.T+" in products[0].input[1] or "self_attn.q_proj.weight.T+" in products[0].input[1]
    found = read_graph_weights(path)
    for name, tensor in model.graph_layer(0).state_dict().items():
        np.testing.assert_array_equal(found[name], tensor.numpy(), err_msg=name)


def test_a_fused_weight_without_its_widths_is_refused():
    from runtime.errors import ArtifactError
    from runtime.artifact.manifest import split_fused

    w = np.zeros((4, 6), np.float32)
    assert [a.shape for a in split_fused({"a.T+b.T": w, "a.T+b.T:widths": np.array([2, 4])}).values()] \
        == [(4, 2), (4, 4)]
    with pytest.raises(ArtifactError, match=r"fused weight 'a.T\+b.T' has no 'a.T\+b.T:widths' beside it"):
        split_fused({"a.T+b.T": w})


def _inputs(model, batch, sequence, pasts, pads, seed):
    """A runtime's binding: each row's valid past at the front of a bound width of whole pages, then
    ``sequence`` new positions whose first ``pads[r]`` are left padding; the K/V past a row's
    length is random (an earlier occupant's)."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    nkv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width = max(PAGE, -(-(max(pasts) + sequence) // PAGE) * PAGE)
    mask = torch.zeros(batch, width + sequence, dtype=torch.int64)
    for r, (past, pad) in enumerate(zip(pasts, pads)):
        mask[r, :past] = 1
        mask[r, width + pad:] = 1
    return {"hidden_states": torch.randn(batch, sequence, c.hidden_size, generator=g),
            "attention_mask": mask,
            "past_key": torch.randn(batch, nkv, hd, width, generator=g),
            "past_value": torch.randn(batch, nkv, width, hd, generator=g)}


CASES = {
    "prefill, left padding": dict(batch=2, sequence=5, pasts=[0, 0], pads=[2, 0]),
    "decode, one row": dict(batch=1, sequence=1, pasts=[11], pads=[0]),
    "decode, rows of different pasts": dict(batch=3, sequence=1, pasts=[9, 4, 17], pads=[0, 0, 0]),
    "later chunk, batch 2": dict(batch=2, sequence=3, pasts=[6, 2], pads=[0, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_graph_matches_the_pytorch_layer(layer, case):
    variant, model, path = layer
    inputs = _inputs(model, **CASES[case], seed=len(case))
    with torch.no_grad():
        expected = model.graph_layer(0)(*inputs.values())
    got = _session(path).run(None, {k: v.numpy() for k, v in inputs.items()})
    for name, want, have in zip(["hidden_states_out", "new_key", "new_value"], expected, got):
        assert have.shape == tuple(want.shape), name
        np.testing.assert_allclose(have, want.numpy(), rtol=1e-4, atol=1e-4, err_msg=f"{variant} {name}")


def test_reshape_reads_zero_and_minus_one_as_onnx_does():
    x = torch.arange(2 * 3 * 8).reshape(2, 3, 8)
    assert torch.equal(reshape(x, 0, -1, 2, 4), x.view(2, 3, 2, 4))
    assert torch.equal(reshape(x.view(2, 3, 2, 4), 0, -1, 0), x.view(2, 12, 2))  # 0 at index 2: dim 2


# The embedding and the head once per step: OPT's embed 18 -> 12 nodes (its last T positions one
# Slice, not a Range-indexed Gather), its head 15 -> 6 (one Reshape back to (B, T, V)).
@pytest.mark.parametrize("variant, name, limit", [("opt", "embed", 12), ("opt", "head", 6),
                                                  ("llama3", "embed", 6), ("llama3", "head", 6)])
def test_embed_and_head_graphs_are_lean_and_match_pytorch(variant, name, limit, tmp_path):
    model = _model(variant)
    path = _export(model, name, tmp_path)
    assert len(_optimized_ops(path, tmp_path)) <= limit
    case = _inputs(model, **CASES["later chunk, batch 2"], seed=3)
    if name == "embed":
        inputs = {"input_ids": torch.randint(3, model.config.vocab_size, (2, 3)),
                  "attention_mask": case["attention_mask"]}
    else:
        inputs = {"hidden_states": case["hidden_states"]}
    with torch.no_grad():
        want = getattr(model, name)(*inputs.values())
    (got,) = _session(path).run(None, {k: v.numpy() for k, v in inputs.items()})
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


# `export build --opset 14..16`: Shape has no start/end attributes before opset 15, so the graphs
# take a Shape's dims with a Slice of constant axes there instead.
@pytest.mark.parametrize("opset", [14, 16])
@pytest.mark.parametrize("variant", ["opt", "llama3"])
def test_older_opsets_export_valid_graphs_equal_to_pytorch(variant, opset, tmp_path):
    model = _model(variant)
    path = _export(model, "layer_00", tmp_path, opset)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert not [f for findings in check_graph(path, ["8.6", "10.3"]).values() for f in findings if f.severity == "error"]
    inputs = _inputs(model, **CASES["prefill, left padding"], seed=5)
    with torch.no_grad():
        expected = model.graph_layer(0)(*inputs.values())
    got = _session(path).run(None, {k: v.numpy() for k, v in inputs.items()})
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want.numpy(), rtol=1e-4, atol=1e-4)
