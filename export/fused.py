"""ONNX Runtime's fused-operator variant of a Llama-family layer graph (``layer_NN.gqa.onnx``).

The plain layer graphs (export.onnx_export) are plain ONNX so that TensorRT parses them; on ONNX
Runtime's CPU provider their attention, built from ~60 small operators (RoPE's angles, the causal
mask, the split matmuls), costs more than the layer's products at small sizes (docs/benchmarks.md,
"Where a layer's time goes"). This variant is the same layer on ONNX Runtime's contrib operators, as
onnxruntime-genai's model builder writes them: SimplifiedLayerNormalization, the plain graph's own
q/k/v and gate/up products (MatMul or MatMulNBits, the same initializers in the same weights.bin),
one GroupQueryAttention (RoPE, the causal mask and the K/V write inside; Qwen3's q/k norms before it) and
SkipSimplifiedLayerNormalization: ~12 nodes where the plain graph has ~120.

Its contract differs from the plain graph's only where GroupQueryAttention needs it:

  layer_NN (gqa): hidden_states (batch, sequence, hidden),
                  attention_bias (batch, 1, sequence, past_sequence) float: 0 where a query may
                      attend a key position, MASK_VALUE where the key is padding or unused,
                  position_ids (batch, sequence) int64: the RoPE positions (the plain graph's
                      mask_positions, padding clipped to 0),
                  seqlens_k (batch,) int32: each row's positions after the call, minus one,
                  total_sequence_length () int32: past_sequence (the width bound),
                  query_seqlens (batch,) int32: the call's tokens a row runs (0: the row skips
                      this layer and its K/V are left as they are),
                  past_key, past_value (batch, kv_heads, past_sequence, head_dim)
               -> hidden_states_out (batch, sequence, hidden),
                  present_key, present_value: the same buffers as the past, bound in place; each
                      row's new K/V written at its own positions [length, length + sequence).

K is stored as V is, (..., past_sequence, head_dim), not transposed. ``runtime.gqa`` turns the
runtime's mask and row lengths into these inputs; the ONNX Runtime backend uses the variant when the
manifest lists it (``Manifest.fused``) and its provider is the CPU's; export.parity.check_fused
checks it against PyTorch.

Written for float32 artifacts of the Llama family (head_dim a multiple of 16, GroupQueryAttention's
CPU requirement), float or MatMulNBits weights; other artifacts have none and run the plain graphs.
"""

from __future__ import annotations

import numpy as np

from runtime import gqa
from runtime.artifact.manifest import FUSED, TRANSPOSED, GraphSpec, TensorSpec
from runtime.gqa import FUSED_INPUTS, FUSED_OUTPUTS
from runtime.models import head_dim, kv_heads

from .gguf_blocks import is_minimums, product_base, product_nodes, product_weight

SUFFIX = ".gqa.onnx"  # layer_NN.onnx -> layer_NN.gqa.onnx
OPSET_MS = 1  # com.microsoft's opset
_PROJECTIONS = {  # role -> the weights of the plain graph's product, in order (export.weights.fuse_sibling_matmuls)
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}


def why_not(config, dtype: str, weights_format: str) -> str | None:
    """Why a model gets no fused variant (None: it gets one)."""
    from runtime.models import family_of

    if family_of(config).name == "opt":
        return "OPT layers have no fused variant (learned positions, LayerNorm)"
    if dtype != "float32":
        return "the fused variant is for float32 artifacts (ONNX Runtime's CPU provider)"
    if weights_format != "matmulnbits":
        return f"the fused variant reads float or MatMulNBits weights, not {weights_format}"
    if head_dim(config) % 16:
        return f"GroupQueryAttention's CPU kernel needs head_dim a multiple of 16, not {head_dim(config)}"
    return gqa.why_unsupported()  # the build checks each graph in a session of this onnxruntime


def file_of(plain_file: str) -> str:
    """The fused variant's file beside plain layer graph ``plain_file``."""
    return plain_file.replace(".onnx", SUFFIX)


def graph_spec(spec: GraphSpec, kv: int, hd: int) -> GraphSpec:
    """The fused variant's I/O for plain layer graph ``spec``."""
    dims = {"hidden_states": spec.inputs[0].dims, "hidden_states_out": spec.outputs[0].dims,
            "attention_bias": ["batch", 1, "sequence", "past_sequence"], "position_ids": ["batch", "sequence"],
            "seqlens_k": ["batch"], "total_sequence_length": [], "query_seqlens": ["batch"]}
    dtypes = {"position_ids": "int64", "seqlens_k": "int32", "total_sequence_length": "int32",
              "query_seqlens": "int32"}
    kv_dims = ["batch", kv, "past_sequence", hd]
    tensor = lambda n: TensorSpec(n, dtypes.get(n, "float32"), dims.get(n, kv_dims))  # noqa: E731
    return GraphSpec(spec.name, file_of(spec.file), [tensor(n) for n in FUSED_INPUTS],
                     [tensor(n) for n in FUSED_OUTPUTS], spec.data_file)


def rope_tables(layer, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's cos and sin caches (positions, head_dim / 2), computed as the plain
    graph computes its angles (runtime.models.llama.CachedLlamaLayer._rope: fp32 positions times the
    checkpoint's inverse frequencies, then cos and sin in fp32, times the attention factor), so the
    rotation is the same bits."""
    import torch

    half = layer.head_dim // 2
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * layer.freq[None, :half]  # (P, hd/2)
    return ((angles.cos() * layer.rope_scale).numpy().astype(np.float32),
            (angles.sin() * layer.rope_scale).numpy().astype(np.float32))


def _parts(node) -> list[str]:
    """The checkpoint weights a product of the plain graph multiplies by, in order: its weight's
    name less the quantizer's suffix ("_Q4", and a run's "_part0": export.gguf_blocks.carry), split at
    FUSED, each less TRANSPOSED."""
    name = product_weight(node.input[1]) if node.op_type == "MatMulNBits" else node.input[1]
    return [part.removesuffix(TRANSPOSED) for part in name.split(FUSED)]


def fused_layer(plain, layer, config, spec: GraphSpec):
    """The fused variant (an onnx.ModelProto) of ``plain``, the final plain graph of ``layer``
    (runtime.models.llama.CachedLlamaLayer) before its weights are externalized: its products are copied
    with their initializers, so the shared weights file stores them once. Its RoPE tables cover
    the checkpoint's max_position_embeddings."""
    import onnx
    from onnx import helper, numpy_helper

    graph = plain.graph
    inits = {t.name: t for t in graph.initializer}
    products = {}
    for node in graph.node:
        if node.op_type in ("MatMul", "MatMulNBits") and len(node.input) > 1 and node.input[1] in inits \
                and not is_minimums(node):
            role = next((r for r, parts in _PROJECTIONS.items() if _parts(node)[0] == parts[0]), None)
            if role:
                products.setdefault(role, node)  # a product carried in runs: its first
    missing = [r for r in _PROJECTIONS if r not in products]
    if missing:
        raise ValueError(f"{spec.name}'s plain graph has no {missing} product: it was not written by "
                         f"export.onnx_export; this is a bug in the exporter")
    if any(_parts(products[r]) != list(_PROJECTIONS[r]) for r in _PROJECTIONS):
        raise ValueError(f"{spec.name}: q/k/v or gate/up are not one product in that order; this is a bug "
                         f"in the exporter")

    attn = layer.self_attn
    eps = float(layer.input_layernorm.variance_epsilon)
    keep: list = []  # initializers of the fused graph
    nodes: list = []

    def copy(role: str, x: str, out: str) -> None:
        group = product_nodes(graph, products[role])  # a carried Q4_1 product: its minimums' term too
        product = product_base(products[role].name)
        names = {products[role].input[0]: x, group[-1].output[0]: out}
        rename = lambda t: t if not t or t in inits else names.get(t, f"/{role}:{t}")  # noqa: E731
        for original in group:
            node = onnx.NodeProto()
            node.CopyFrom(original)
            node.input[:] = [rename(t) for t in original.input]
            node.output[:] = [rename(t) for t in original.output]
            node.name = f"/{role}{original.name[len(product):]}"
            nodes.append(node)
            keep.extend(inits[i] for i in node.input if i in inits)

    def const(name: str, array: np.ndarray) -> str:
        keep.append(numpy_helper.from_array(array, name))
        return name

    def norm_weight(module, name: str) -> str:
        keep.append(inits[name] if name in inits else numpy_helper.from_array(
            module.weight.detach().float().numpy(), name))
        return name

    ln_in = norm_weight(layer.input_layernorm, "input_layernorm.weight")
    ln_post = norm_weight(layer.post_attention_layernorm, "post_attention_layernorm.weight")
    nodes.append(helper.make_node("SimplifiedLayerNormalization", ["hidden_states", ln_in], ["/x"],
                                  axis=-1, epsilon=eps, stash_type=1, name="/input_layernorm"))
    copy("qkv", "/x", "/qkv")
    query = "/qkv"
    if attn.q_proj.bias is not None:  # Qwen2: the biases of q, k, v side by side, as the weights are
        bias = np.concatenate([p.bias.detach().float().numpy() for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        nodes.append(helper.make_node("Add", ["/qkv", const("self_attn.qkv_proj.bias", bias)], ["/qkv_b"],
                                      name="/qkv_bias"))
        query = "/qkv_b"
    cos, sin = rope_tables(layer, config.max_position_embeddings)
    # GroupQueryAttention's inputs in its order: query (or packed q/k/v), key, value, past_key,
    # past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias,
    # head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight, query_seqlens ("": not given)
    gqa_inputs = [query, "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                  const("rope.cos_cache", cos), const("rope.sin_cache", sin), "position_ids", "attention_bias",
                  "", "", "", "", "", "query_seqlens"]
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's q and k before RoPE (ONNX Runtime's CPU
        # GroupQueryAttention has no q/k norm inputs): q, k, v apart, each head normalised
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        widths = const("self_attn.qkv:widths", np.array([nh * hd, nkv * hd, nkv * hd], np.int64))
        nodes.append(helper.make_node("Split", [query, widths], ["/q", "/k", "/v"], axis=-1, name="/qkv_split"))
        for part, heads, norm in (("q", nh, attn.q_norm), ("k", nkv, attn.k_norm)):
            weight = norm_weight(norm, f"self_attn.{part}_norm.weight")
            nodes += [
                helper.make_node("Reshape", [f"/{part}", const(f"{part}:heads", np.array([0, 0, heads, hd], np.int64))],
                                 [f"/{part}_heads"], name=f"/{part}_heads"),
                helper.make_node("SimplifiedLayerNormalization", [f"/{part}_heads", weight], [f"/{part}_norm"],
                                 axis=-1, epsilon=float(norm.variance_epsilon), stash_type=1, name=f"/{part}_norm"),
                helper.make_node("Reshape", [f"/{part}_norm", const(f"{part}:flat", np.array([0, 0, heads * hd], np.int64))],
                                 [f"/{part}_normed"], name=f"/{part}_flat"),
            ]
        gqa_inputs[:3] = ["/q_normed", "/k_normed", "/v"]
    nodes.append(helper.make_node(
        "GroupQueryAttention", gqa_inputs, ["/attn", "present_key", "present_value"], domain="com.microsoft",
        num_heads=layer.num_heads, kv_num_heads=layer.num_kv_heads, do_rotary=1, rotary_interleaved=0,
        scale=float(layer.scaling), name="/attention"))
    copy("o", "/attn", "/o")
    nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ["/o", "hidden_states", ln_post],
                                  ["/y", "", "", "/residual"], domain="com.microsoft", epsilon=eps,
                                  name="/post_attention_layernorm"))
    copy("gate_up", "/y", "/gate_up")
    width = layer.mlp.gate_proj.out_features
    nodes += [
        helper.make_node("Split", ["/gate_up", const("mlp.gate_up:widths", np.array([width, width], np.int64))],
                         ["/gate", "/up"], axis=-1, name="/gate_up_split"),
        helper.make_node("Sigmoid", ["/gate"], ["/gate_sigmoid"], name="/silu_sigmoid"),
        helper.make_node("Mul", ["/gate", "/gate_sigmoid"], ["/silu"], name="/silu"),
        helper.make_node("Mul", ["/silu", "/up"], ["/act"], name="/act"),
    ]
    copy("down", "/act", "/down")
    nodes.append(helper.make_node("Add", ["/residual", "/down"], ["hidden_states_out"], name="/residual_add"))

    dtypes = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64, "int32": onnx.TensorProto.INT32}
    value = lambda t: helper.make_tensor_value_info(t.name, dtypes[t.dtype], t.dims)  # noqa: E731
    fused = graph_spec(spec, kv_heads(config), head_dim(config))
    unique = list({t.name: t for t in keep}.values())
    model = helper.make_model(
        helper.make_graph(nodes, f"{spec.name}_gqa", [value(t) for t in fused.inputs],
                          [value(t) for t in fused.outputs], unique),
        opset_imports=[helper.make_opsetid("", plain.opset_import[0].version),
                       helper.make_opsetid("com.microsoft", OPSET_MS)],
        producer_name="skipdecode-edge")
    model.ir_version = plain.ir_version
    return model


__all__ = ["SUFFIX", "file_of", "fused_layer", "graph_spec", "rope_tables", "why_not"]
