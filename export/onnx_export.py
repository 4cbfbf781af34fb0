"""Trace the skip-aware OPT into per-layer ONNX graphs with explicit KV inputs and outputs.

Graph contract (names are the manifest's; all dims dynamic except the model's own sizes):

  embed:    input_ids (batch, sequence) int64, attention_mask (batch, total_sequence) int64
            -> hidden_states (batch, sequence, hidden)
  layer_NN: hidden_states (batch, sequence, hidden), attention_mask (batch, total_sequence) int64,
            past_key (batch, kv_heads, head_dim, past_sequence),
            past_value (batch, kv_heads, past_sequence, head_dim)
            -> hidden_states_out (batch, sequence, hidden),
               new_key, new_value (batch, kv_heads, sequence, head_dim)
  head:     hidden_states (batch, sequence, hidden) -> logits (batch, sequence, vocab)

total_sequence = past_sequence + sequence: the mask covers the bound past, then the new positions.
The past is a block of rows of a preallocated KV buffer (see runtime.models.opt.CachedOPTLayer): a
runtime binds the rows that run in place, at the buffer's current width past_sequence, and writes
only the new K/V the graph returns into their own positions, so no step copies or concatenates the
past. That width is a whole multiple of the manifest's kv_cache.page_size (the step by which it
grows), at least one page and wide enough for the longest row's past and new positions
(runtime.kvcache); each row's valid past is its own positions [0, length) of it and the mask is 0
over the rest. A later chunk of a prompt binds its rows' block the same way; a prompt's first chunk,
whose rows hold nothing yet, binds one page of zeros, all masked. The embedding gets the same mask (past width + new positions): positions come
from the mask's cumulative sum, so masked columns contribute nothing. kv_heads is the attention
heads for OPT and fewer under grouped-query attention (Llama family, runtime.models.llama), whose layers
derive their RoPE positions from the same mask: every family has this one contract.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.artifact.manifest import DRAFT_HEAD, DRAFT_LAYER_SUFFIX, GraphSpec, TensorSpec, layer_name
from runtime.errors import InvalidArgumentError
from runtime.kvcache import bound_width
from runtime.models import head_dim, kv_heads

from runtime.models.base import SkipModel, graph_module

from . import fused as fused_layers
from . import gguf_blocks
from .quantize import QuantConfig, quantize_graph
from .weights import SharedWeights, fold_weight_transposes, fuse_sibling_matmuls, tie_head, unflatten_head

PROTOBUF_LIMIT = 2 * 1024**3  # protobuf cannot serialise a single message over 2 GB
# Trace sizes: every traced dim >= 2 and distinct, so none is specialised. A layer's valid past
# spans several pages (past_sequence >= 7, total_sequence = that + sequence); the embedding's valid
# past is `past` positions, inside tiny models' positions, its mask as wide as a layer's would be.
_EXAMPLE = dict(batch=2, sequence=3, pages=4, past=4)


@dataclass
class ExportConfig:
    dtype: str = "float32"  # "float32" or "float16"; fp16 keeps softmax and layer norm in fp32
    opset: int = 17  # TorchScript exporter's opset; parsed by TensorRT 8.6 (JetPack 5) and later
    external_data: str = "shared"  # "shared": every graph's weights in one weights.bin (mapped
    # in place by ONNX Runtime, tied embedding once: export.weights); "never": self-contained graphs
    page_size: int = 32  # KV positions per page: the step by which the bound past width grows (larger
    # pages: fewer re-lays of the runtime's cache as rows grow, more masked columns read per step)
    quant: QuantConfig = field(default_factory=QuantConfig)  # weight-only quantization (float: none)
    fused: bool = True  # also write each layer's fused-operator variant for ONNX Runtime's CPU
    # provider where the model gets one (export.fused.why_not); the plain graphs are written anyway
    draft_head: str = "none"  # "int8" or "int4": also write the float head at that precision as
    # head_draft.onnx, which lossless rows' drafts read on ONNX Runtime (a verify pass reads the head)
    draft_layers: str = "none"  # "int8" or "int4": also write each fused layer graph at that precision
    # (layer_NN.draft.onnx), which lossless rows' draft steps run on ONNX Runtime's CPU provider
    blocks: object = None  # a quantized GGUF source's export.gguf_blocks.BlockIndex: the products it
    # holds are written from the file's own blocks, not requantized (it lists them as the graphs go)
    draft_blocks: object = None  # the same for the draft copies of a float export (their own list)

    def fused_reason(self, model_config) -> str | None:
        """Why this export writes no fused layer graphs (None: it writes them)."""
        if not self.fused:
            return "not asked for (--no-fused)"
        layers_format = self.quant.format if self.quant.weights != "float" else "matmulnbits"
        return fused_layers.why_not(model_config, self.dtype, layers_format)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be 'float32' or 'float16', got {self.dtype!r}")
        if self.external_data not in ("shared", "never"):
            raise ValueError(f"external_data must be 'shared' or 'never', got {self.external_data!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if self.draft_head not in ("none", "int8", "int4"):
            raise ValueError(f"draft_head must be 'none', 'int8' or 'int4', got {self.draft_head!r}")
        if self.draft_head != "none" and self.quant.for_graph("head") != "float":
            head = self.quant.for_graph("head")
            raise InvalidArgumentError(f"a draft head ({self.draft_head}) beside an {head} head: the head is "
                                       f"already quantized and drafts read it; drop --draft-head")
        if self.draft_layers not in ("none", "int8", "int4"):
            raise ValueError(f"draft_layers must be 'none', 'int8' or 'int4', got {self.draft_layers!r}")
        if self.draft_layers != "none" and self.quant.weights != "float":
            raise InvalidArgumentError(f"draft layers ({self.draft_layers}) beside {self.quant.weights} layers: "
                                       f"the layers are already quantized and drafts run them; drop --draft-layers")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float16 if self.dtype == "float16" else torch.float32


def graph_specs(model: SkipModel, dtype: str) -> list[GraphSpec]:
    """The I/O of every graph, as the manifest records it (the page size is not in any shape: the
    bound past width, past_sequence, is a dynamic dim; the manifest's kv_cache records the page)."""
    c = model.config
    nh, hd = kv_heads(c), head_dim(c)  # the past holds the KV heads only (grouped-query attention)
    hidden = lambda n: TensorSpec(n, dtype, ["batch", "sequence", c.hidden_size])  # noqa: E731
    mask = TensorSpec("attention_mask", "int64", ["batch", "total_sequence"])
    specs = [GraphSpec("embed", "embed.onnx",
                       [TensorSpec("input_ids", "int64", ["batch", "sequence"]), mask],
                       [hidden("hidden_states")])]
    past_key = TensorSpec("past_key", dtype, ["batch", nh, hd, "past_sequence"])  # K transposed
    past_value = TensorSpec("past_value", dtype, ["batch", nh, "past_sequence", hd])
    new = lambda n: TensorSpec(n, dtype, ["batch", nh, "sequence", hd])  # noqa: E731
    for i in range(model.num_layers):
        name = layer_name(i)
        specs.append(GraphSpec(
            name, f"{name}.onnx", [hidden("hidden_states"), mask, past_key, past_value],
            [hidden("hidden_states_out"), new("new_key"), new("new_value")]))
    specs.append(GraphSpec("head", "head.onnx", [hidden("hidden_states")],
                           [TensorSpec("logits", dtype, ["batch", "sequence", c.vocab_size])]))
    return specs


def example_inputs(model: SkipModel, spec: GraphSpec, batch: int, sequence: int, past: int,
                   page_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs for ``spec`` as a runtime binds them: ``past`` valid positions at the front of
    a past ``past_sequence`` wide (``runtime.kvcache.bound_width``: whole pages of ``page_size``
    that hold the past and the new positions; a prefill, past 0, binds one page, all masked); the mask covers that width and then the ``sequence`` new positions, for the embedding
    too. The K/V past the valid positions is random, as an earlier occupant of a row leaves it;
    left padding in row 0 and a shorter past in row 1 exercise the masking of padding and of
    unused positions."""
    g = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    width = bound_width(past, sequence, page_size)  # the past the runtime binds
    sizes = {"batch": batch, "sequence": sequence, "past_sequence": width,
             "total_sequence": width + sequence}
    out = {}
    for t in spec.inputs:
        shape = [sizes.get(d, d) for d in t.dims]
        if t.name == "input_ids":
            out[t.name] = torch.randint(0, model.config.vocab_size, shape, generator=g)
        elif t.name == "attention_mask":
            mask = torch.zeros(shape, dtype=torch.int64)
            mask[:, :past] = 1  # each row's valid past
            mask[:, width:] = 1  # the new positions
            if batch > 1 and past > 1:
                mask[0, : min(2, past - 1)] = 0  # left padding
                mask[1, past - 1] = 0  # a row whose past is one shorter than the longest
            out[t.name] = mask
        else:
            out[t.name] = torch.randn(shape, generator=g).to(dtype)
    return out


def export_graph(model: SkipModel, spec: GraphSpec, directory: Path, config: ExportConfig,
                 weights: SharedWeights | None = None, draft_model: SkipModel | None = None) -> GraphSpec:
    """Trace one graph into ``directory/spec.file``, its large weights into ``weights`` (the
    artifact's shared file; None keeps them inside the graph); returns the spec with data_file set
    when the graph references the shared file. ``draft_model``: the model whose layers a layer's
    draft copy holds (export build --draft-adapter), else ``model``'s own."""
    import onnx

    module = graph_module(model, spec.name)
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    if weights is None and weight_bytes > PROTOBUF_LIMIT * 0.9:
        raise ValueError(
            f"graph {spec.name} holds {weight_bytes / 1e9:.2f} GB of weights, over protobuf's 2 GB "
            f"limit for a self-contained .onnx file; export with external_data='shared'")
    proto = _trace(model, module, spec, directory, config)
    precision = config.quant.for_graph(spec.name)
    if spec.name == "embed" and config.blocks:  # the file's 8-bit blocks of it, not float
        gguf_blocks.carry_embedding(proto, config.blocks)
    if spec.name == "head" and config.draft_head != "none":
        _write_draft_head(onnx.ModelProto.FromString(proto.SerializeToString()), directory, config, weights)
    if spec.name == "head" and precision == "float":
        tie_head(proto)  # a quantized head keeps its own (much smaller) copy instead
    fold_weight_transposes(proto)
    fuse_sibling_matmuls(proto)  # q/k/v and gate/up (or fc1 alone): one MatMul each
    if precision != "float":
        q = config.quant
        proto = quantize_graph(proto, precision, q.block_size, q.format, q.accuracy_level, config.blocks)
        if spec.name == "head":
            unflatten_head(proto)
    fused = None
    if spec.name.startswith("layer_") and config.fused_reason(model.config) is None:
        fused = fused_layers.fused_layer(proto, module, model.config, spec)
    draft = None
    if fused is not None and config.draft_layers != "none":
        source, draft_module, draft_config, blocks = proto, module, model.config, config.draft_blocks
        if draft_model is not None:  # another model's layer: traced, folded and fused the same way
            draft_module, draft_config, blocks = graph_module(draft_model, spec.name), draft_model.config, None
            source = _trace(draft_model, draft_module, spec, directory, config)
            fold_weight_transposes(source)
            fuse_sibling_matmuls(source)
        # quantized before the float weights go to the shared file: the draft keeps its own copy; and
        # before fusing, as the layers of a quantized export are, so that a GGUF's blocks are found
        q = config.quant
        source = quantize_graph(onnx.ModelProto.FromString(source.SerializeToString()), config.draft_layers,
                                q.block_size, "matmulnbits", q.accuracy_level, blocks)
        draft = fused_layers.fused_layer(source, draft_module, draft_config, spec)
    if weights is not None:
        weights.externalize(proto)
        if fused is not None:  # the same products' weights: stored once
            weights.externalize(fused)
        if draft is not None:
            weights.externalize(draft)
    onnx.save_model(proto, str(directory / spec.file))
    if fused is not None:
        onnx.save_model(fused, str(directory / fused_layers.file_of(spec.file)))
    if draft is not None:
        onnx.save_model(draft, str(directory / draft_layer_file(spec.file)))
    return GraphSpec(spec.name, spec.file, spec.inputs, spec.outputs,
                     weights.name if weights is not None else None)


def _trace(model: SkipModel, module, spec: GraphSpec, directory: Path, config: ExportConfig):
    """``module`` (``model``'s graph ``spec.name``) traced to an ONNX proto, weights inside."""
    import onnx

    # A layer's valid past ends inside its fourth page (so a page of one position still gives a
    # past_sequence >= 7, distinct from batch and sequence); the embedding's stays inside tiny
    # models' positions.
    page, pages = config.page_size, _EXAMPLE["pages"]
    past = (pages - 1) * page + 1 if spec.name.startswith("layer_") else _EXAMPLE["past"]
    inputs = example_inputs(model, spec, _EXAMPLE["batch"], _EXAMPLE["sequence"], past, page)
    dynamic_axes = {t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
                    for t in [*spec.inputs, *spec.outputs]}
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
    return proto


def embed_table_entry(model: SkipModel, spec: GraphSpec, directory: Path) -> dict | None:
    """The manifest's ``embed_table`` (runtime.artifact.embed_table) for the exported embedding graph
    ``spec``: where its one table lies in the shared weights file, if the family's embedding is a
    plain lookup (``plain_lookup``) and the table is there; else None (the runtime runs the graph).
    export's checks hold the lookup to the graph, value for value (export.parity.compare_embed_table)."""
    import onnx

    if not getattr(graph_module(model, "embed"), "plain_lookup", False):
        return None
    proto = onnx.load(str(Path(directory) / spec.file), load_external_data=False)
    external = {}  # initializer name -> (file, offset, dims)
    for t in proto.graph.initializer:
        where = {e.key: e.value for e in t.external_data}
        if t.data_location == onnx.TensorProto.EXTERNAL and "location" in where:
            external[t.name] = (where["location"], int(where.get("offset", 0)), list(t.dims))
    levels = [n for n in external if n.endswith(gguf_blocks.LEVELS)]
    if levels:  # the file's 8-bit blocks, gathered (gguf_blocks.carry_embedding)
        table = levels[0].removesuffix(gguf_blocks.LEVELS)
        file, offset, (vocab, blocks, block) = external[levels[0]]
        parts = {"scales": gguf_blocks.SCALES, "minimums": gguf_blocks.MINIMUMS}
        return {"file": file, "offset": offset, "shape": [vocab, blocks * block], "block": block,
                **{k: external[table + suffix][1] for k, suffix in parts.items() if table + suffix in external}}
    if len(proto.graph.initializer) != 1 or len(external) != 1:
        return None  # inside the graph (external_data="never"), or not one table
    file, offset, dims = external[proto.graph.initializer[0].name]
    return {"file": file, "offset": offset, "shape": dims}


def draft_head_spec(head: GraphSpec) -> GraphSpec:
    """The manifest's entry for ``head_draft.onnx``: the head's inputs and outputs."""
    return GraphSpec(DRAFT_HEAD, f"{DRAFT_HEAD}.onnx", head.inputs, head.outputs, head.data_file)


def draft_layer_file(plain_file: str) -> str:
    """The draft layer graph's file beside plain layer graph ``plain_file``: layer_NN.draft.onnx."""
    return plain_file.replace(".onnx", DRAFT_LAYER_SUFFIX)


def draft_layer_spec(fused: GraphSpec, plain_file: str) -> GraphSpec:
    """The manifest's entry for a layer's draft graph: the fused graph's inputs and outputs (its
    products quantized: export --draft-layers)."""
    return GraphSpec(fused.name, draft_layer_file(plain_file), fused.inputs, fused.outputs, fused.data_file)


def _write_draft_head(proto, directory: Path, config: ExportConfig, weights: SharedWeights | None) -> None:
    """The traced float head (weights inside) quantized to ``config.draft_head`` as MatMulNBits, saved
    beside it as head_draft.onnx: a lossless row's draft step reads 3.5x-7x fewer head bytes, and
    the verify pass, which decides every kept token, still reads the float head."""
    import onnx

    fold_weight_transposes(proto)
    q = config.quant
    proto = quantize_graph(proto, config.draft_head, q.block_size, "matmulnbits", q.accuracy_level, config.draft_blocks)
    unflatten_head(proto)
    if weights is not None:
        weights.externalize(proto)
    onnx.save_model(proto, str(directory / f"{DRAFT_HEAD}.onnx"))
