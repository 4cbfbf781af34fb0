"""Trace the skip-aware OPT into per-layer ONNX graphs with explicit KV inputs and outputs.

Graph contract (names are the manifest's; all dims dynamic except the model's own sizes):

  embed:    input_ids (batch, sequence) int64, attention_mask (batch, total_sequence) int64
            -> hidden_states (batch, sequence, hidden)
  layer_NN: hidden_states (batch, sequence, hidden), attention_mask (batch, total_sequence) int64,
            past_key (past_pages, batch, heads, head_dim, page_size),
            past_value (past_pages, batch, heads, page_size, head_dim)
            -> hidden_states_out (batch, sequence, hidden),
               new_key, new_value (batch, heads, sequence, head_dim)
  head:     hidden_states (batch, sequence, hidden) -> logits (batch, sequence, vocab)

total_sequence = past_pages * page_size + sequence. The past is a prefix of a page-major KV buffer
(see runtime.modeling.PagedOPTLayer): a runtime binds it in place and writes only the new K/V the
graph returns into its own positions, so no step copies or concatenates the past. A prefill passes
one all-masked page.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.manifest import GraphSpec, TensorSpec, layer_name

from runtime.modeling import SkipOPT, graph_module

from .quantize import QuantConfig, quantize_graph
from .weights import SharedWeights, fold_weight_transposes, tie_head

PROTOBUF_LIMIT = 2 * 1024**3  # protobuf cannot serialise a single message over 2 GB
_EXAMPLE = dict(batch=2, sequence=3, pages=4, past=4)  # trace sizes: >= 2 and distinct, so none is specialised


@dataclass
class ExportConfig:
    dtype: str = "float32"  # "float32" or "float16"; fp16 keeps softmax and layer norm in fp32
    opset: int = 17  # TorchScript exporter's opset; parsed by TensorRT 8.6 (JetPack 5) and later
    external_data: str = "shared"  # "shared": every graph's weights in one weights.bin (mapped
    # in place by ONNX Runtime, tied embedding once: export.weights); "never": self-contained graphs
    page_size: int = 32  # KV positions per page: the granularity of the past a step reads (measured
    # on OPT-125m shapes, 16-64 cost the same within noise; smaller pages mean more tiny matmuls)
    quant: QuantConfig = field(default_factory=QuantConfig)  # weight-only quantization (float: none)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}")
        if self.external_data not in ("shared", "never"):
            raise ValueError(f"external_data must be 'shared' or 'never', got {self.external_data!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {self.page_size!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "float16" else torch.float32


def graph_specs(model: SkipOPT, dtype: str, page_size: int) -> list[GraphSpec]:
    """The I/O of every graph, as the manifest records it."""
    c = model.config
    nh = c.num_attention_heads
    hd = c.hidden_size // nh
    hidden = lambda n: TensorSpec(n, dtype, ["batch", "sequence", c.hidden_size])  # noqa: E731
    mask = TensorSpec("attention_mask", "int64", ["batch", "total_sequence"])
    specs = [GraphSpec("embed", "embed.onnx",
                       [TensorSpec("input_ids", "int64", ["batch", "sequence"]), mask],
                       [hidden("hidden_states")])]
    past_key = TensorSpec("past_key", dtype, ["past_pages", "batch", nh, hd, page_size])
    past_value = TensorSpec("past_value", dtype, ["past_pages", "batch", nh, page_size, hd])
    new = lambda n: TensorSpec(n, dtype, ["batch", nh, "sequence", hd])  # noqa: E731
    for i in range(model.num_layers):
        name = layer_name(i)
        specs.append(GraphSpec(
            name, f"{name}.onnx", [hidden("hidden_states"), mask, past_key, past_value],
            [hidden("hidden_states_out"), new("new_key"), new("new_value")]))
    specs.append(GraphSpec("head", "head.onnx", [hidden("hidden_states")],
                           [TensorSpec("logits", dtype, ["batch", "sequence", c.vocab_size])]))
    return specs


def example_inputs(model: SkipOPT, spec: GraphSpec, batch: int, sequence: int, past: int,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs for ``spec``: ``past`` valid positions (in at least one page), left padding in
    row 0 and a shorter past in row 1 (so masking of padding and of unused positions is exercised)."""
    g = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    page = next((t.dims[-1] for t in spec.inputs if t.name == "past_key"), 1)
    pages = max(1, -(-past // page))
    bound = pages * page if spec.name.startswith("layer_") else past  # the mask's past width
    sizes = {"batch": batch, "sequence": sequence, "past_pages": pages,
             "total_sequence": bound + sequence}
    out = {}
    for t in spec.inputs:
        shape = [sizes.get(d, d) for d in t.dims]
        if t.name == "input_ids":
            out[t.name] = torch.randint(0, model.config.vocab_size, shape, generator=g)
        elif t.name == "attention_mask":
            mask = torch.zeros(shape, dtype=torch.int64)
            mask[:, :past] = 1  # each row's valid past
            mask[:, bound:] = 1  # the new positions
            if batch > 1 and past > 1:
                mask[0, : min(2, past - 1)] = 0  # left padding
                mask[1, past - 1] = 0  # a row whose past is one shorter than the longest
            out[t.name] = mask
        else:
            out[t.name] = torch.randn(shape, generator=g).to(dtype)
    return out


def export_graph(model: SkipOPT, spec: GraphSpec, directory: Path, config: ExportConfig,
                 weights: SharedWeights | None = None) -> GraphSpec:
    """Trace one graph into ``directory/spec.file``, its large weights into ``weights`` (the
    artifact's shared file; None keeps them inside the graph); returns the spec with data_file set
    when the graph references the shared file."""
    import onnx

    module = graph_module(model, spec.name)
    # A layer's past spans several pages; the embedding's stays inside tiny models' positions.
    past = _EXAMPLE["pages"] * config.page_size - 1 if spec.name.startswith("layer_") else _EXAMPLE["past"]
    inputs = example_inputs(model, spec, _EXAMPLE["batch"], _EXAMPLE["sequence"], past)
    dynamic_axes = {t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
                    for t in [*spec.inputs, *spec.outputs]}
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    if weights is None and weight_bytes > PROTOBUF_LIMIT * 0.9:
        raise ValueError(
            f"graph {spec.name} holds {weight_bytes / 1e9:.2f} GB of weights, over protobuf's 2 GB "
            f"limit for a self-contained .onnx file; export with external_data='shared'")
    # Trace into a scratch folder: over 2 GB the exporter scatters one file per tensor there.
    scratch = directory / f".scratch-{spec.name}"
    scratch.mkdir()
    traced = scratch / spec.file
    with warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter is deprecated in favour of dynamo, but it is fast and its graphs
        # are plain enough for TensorRT 8.6; silence its deprecation and tracer warnings.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, tuple(inputs.values()), str(traced), dynamo=False,
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            dynamic_axes=dynamic_axes, opset_version=config.opset, do_constant_folding=False)
    proto = onnx.load(str(traced), load_external_data=True)
    shutil.rmtree(scratch)
    precision = config.quant.for_graph(spec.name)
    if spec.name == "head" and precision == "float":
        tie_head(proto)  # a quantized head keeps its own (much smaller) copy instead
    fold_weight_transposes(proto)
    if precision != "float":
        q = config.quant
        proto = quantize_graph(proto, precision, q.block_size, q.format, q.accuracy_level)
    if weights is not None:
        weights.externalize(proto)
    onnx.save_model(proto, str(directory / spec.file))
    return GraphSpec(spec.name, spec.file, spec.inputs, spec.outputs,
                     weights.name if weights is not None else None)
