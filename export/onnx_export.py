"""Trace the skip-aware OPT into per-layer ONNX graphs with explicit KV inputs and outputs.

Graph contract (names are the manifest's; all dims dynamic except the model's own sizes):

  embed:    input_ids (batch, sequence) int64, attention_mask (batch, total_sequence) int64
            -> hidden_states (batch, sequence, hidden)
  layer_NN: hidden_states, attention_mask, past_key, past_value (batch, heads, past_sequence, head_dim)
            -> hidden_states_out, present_key, present_value (batch, heads, total_sequence, head_dim)
  head:     hidden_states (batch, sequence, hidden) -> logits (batch, sequence, vocab)

total_sequence = past_sequence + sequence; a past of length 0 is valid (the prompt pass).
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.manifest import GraphSpec, TensorSpec, layer_name

from .modeling import SkipOPT

EXTERNAL_DATA_LIMIT = 2 * 1024**3  # protobuf cannot serialise a single message over 2 GB
_EXAMPLE = dict(batch=2, sequence=3, past=4)  # trace sizes: >= 2 and distinct, so none is specialised


@dataclass
class ExportConfig:
    dtype: str = "float32"  # "float32" or "float16"; fp16 keeps softmax and layer norm in fp32
    opset: int = 17  # TorchScript exporter's opset; parsed by TensorRT 8.6 (JetPack 5) and later
    external_data: str = "auto"  # "auto": only graphs whose weights pass 2 GB; "always"; "never"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}")
        if self.external_data not in ("auto", "always", "never"):
            raise ValueError(f"external_data must be auto, always or never, got {self.external_data!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "float16" else torch.float32


def graph_specs(model: SkipOPT, dtype: str) -> list[GraphSpec]:
    """The I/O of every graph, as the manifest records it."""
    c = model.config
    nh = c.num_attention_heads
    hd = c.hidden_size // nh
    hidden = lambda n: TensorSpec(n, dtype, ["batch", "sequence", c.hidden_size])  # noqa: E731
    mask = TensorSpec("attention_mask", "int64", ["batch", "total_sequence"])
    kv = lambda n, s: TensorSpec(n, dtype, ["batch", nh, s, hd])  # noqa: E731
    specs = [GraphSpec("embed", "embed.onnx",
                       [TensorSpec("input_ids", "int64", ["batch", "sequence"]), mask],
                       [hidden("hidden_states")])]
    for i in range(model.num_layers):
        name = layer_name(i)
        specs.append(GraphSpec(
            name, f"{name}.onnx",
            [hidden("hidden_states"), mask, kv("past_key", "past_sequence"), kv("past_value", "past_sequence")],
            [hidden("hidden_states_out"), kv("present_key", "total_sequence"),
             kv("present_value", "total_sequence")]))
    specs.append(GraphSpec("head", "head.onnx", [hidden("hidden_states")],
                           [TensorSpec("logits", dtype, ["batch", "sequence", c.vocab_size])]))
    return specs


def example_inputs(model: SkipOPT, spec: GraphSpec, batch: int, sequence: int, past: int,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs for ``spec`` with left padding in row 0 (so masking is exercised)."""
    g = torch.Generator().manual_seed(seed)
    total = past + sequence
    dtype = model.dtype
    sizes = {"batch": batch, "sequence": sequence, "past_sequence": past, "total_sequence": total}
    out = {}
    for t in spec.inputs:
        shape = [sizes.get(d, d) for d in t.dims]
        if t.name == "input_ids":
            out[t.name] = torch.randint(0, model.config.vocab_size, shape, generator=g)
        elif t.name == "attention_mask":
            mask = torch.ones(shape, dtype=torch.int64)
            if batch > 1 and total > 1:
                mask[0, : min(2, total - 1)] = 0  # left padding, never the current token
            out[t.name] = mask
        else:
            out[t.name] = torch.randn(shape, generator=g).to(dtype)
    return out


def module_for(model: SkipOPT, name: str) -> torch.nn.Module:
    if name == "embed":
        return model.embed
    if name == "head":
        return model.head
    return model.layers[int(name.split("_")[1])]


def export_graph(model: SkipOPT, spec: GraphSpec, directory: Path, config: ExportConfig) -> GraphSpec:
    """Trace one graph into ``directory/spec.file``; returns the spec with data_file set if used."""
    module = module_for(model, spec.name)
    inputs = example_inputs(model, spec, _EXAMPLE["batch"], _EXAMPLE["sequence"], _EXAMPLE["past"])
    dynamic_axes = {t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
                    for t in [*spec.inputs, *spec.outputs]}
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    external = config.external_data == "always" or (
        config.external_data == "auto" and weight_bytes > EXTERNAL_DATA_LIMIT * 0.9)
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
    data_file = None
    if external or len(list(scratch.iterdir())) > 1:
        import onnx

        data_file = spec.file + ".data"
        proto = onnx.load(str(traced), load_external_data=True)
        onnx.save_model(proto, str(directory / spec.file), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_file, size_threshold=1024)
    else:
        traced.replace(directory / spec.file)
    shutil.rmtree(scratch)
    return GraphSpec(spec.name, spec.file, spec.inputs, spec.outputs, data_file)
