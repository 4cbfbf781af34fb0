"""Weight layout of an artifact: every graph's large initializers in one shared, aligned file.

Why (peak RSS of ``runtime.load`` + generate, ONNX Runtime CPU, OPT-125m random weights, measured
on this repository's 2-core machine; see docs/benchmarks.md "Memory"):

* ONNX Runtime memory-maps external data instead of reading it into its heap, so weights cost RSS
  only once a kernel touches them, and a kernel that packs its weights (MatMul, Gemm) lets the
  mapping go once packed: one copy of the weights in memory instead of two or three.
* The TorchScript exporter writes ``MatMul(x, Transpose(W))`` for every ``nn.Linear``; ONNX
  Runtime constant-folds each Transpose at session start into a transposed copy of W (a second
  copy of all weights). ``fold_weight_transposes`` stores W already transposed instead.
* OPT ties ``lm_head.weight`` to ``embed_tokens.weight``: the head graph uses
  ``Gemm(x, W, transB=1)`` on the embedding's own layout (``tie_head``) and the shared file holds
  the matrix once (equal tensors are written once, whichever graphs use them), so an artifact is
  vocab x hidden smaller (412 MB for OPT-1.3B fp32) and the embed graph reads only the rows of
  the tokens it looks up.

The files stay plain ONNX with external data (location / offset / length), which ONNX Runtime,
TensorRT's parser and ``onnx.load`` all read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from runtime.artifact.manifest import FUSED, TRANSPOSED, WIDTHS

WEIGHTS_FILE = "weights.bin"  # one file for the whole artifact, beside the graphs
ALIGNMENT = 4096  # each tensor starts on a page: mappable in place, and aligned for SIMD loads
INLINE_LIMIT = 1024  # smaller tensors (scalars, tiny biases) stay inside the .onnx, as onnx does
HEAD_WEIGHT = "lm_head.weight"


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    uses: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            uses.setdefault(name, []).append(node)
    for out in graph.output:
        uses.setdefault(out.name, []).append(None)  # a graph output is a use no rewrite may drop
    return uses


def _transposes_of_initializers(graph: onnx.GraphProto):
    """(Transpose node, initializer) pairs where the initializer's only use is that Transpose."""
    inits = {t.name: t for t in graph.initializer}
    uses = _consumers(graph)
    for node in list(graph.node):
        if node.op_type == "Transpose" and node.input[0] in inits and len(uses[node.input[0]]) == 1:
            yield node, inits[node.input[0]], uses.get(node.output[0], [])


def tie_head(model: onnx.ModelProto) -> bool:
    """Rewrite the head's ``MatMul(x, Transpose(lm_head.weight))`` as ``Gemm(x, lm_head.weight,
    transB=1)``, keeping the weight in the embedding's (vocab, hidden) layout so both graphs can
    share it. ``x`` is 2-D there (runtime.models.opt.OPTHead flattens batch and sequence for this).
    Returns whether the pattern was found."""
    graph = model.graph
    for node, init, users in _transposes_of_initializers(graph):
        if init.name != HEAD_WEIGHT or len(users) != 1 or users[0] is None or users[0].op_type != "MatMul":
            continue
        matmul = users[0]
        if list(matmul.input) != [matmul.input[0], node.output[0]]:
            continue
        gemm = onnx.helper.make_node("Gemm", [matmul.input[0], init.name], list(matmul.output),
                                     name=matmul.name or "lm_head_gemm", transB=1)
        at = list(graph.node).index(matmul)
        graph.node.remove(matmul)
        graph.node.insert(at, gemm)
        graph.node.remove(node)
        return True
    return False


def unflatten_head(model: onnx.ModelProto) -> bool:
    """Feed a quantized head's MatMulNBits the (batch, sequence, hidden) states themselves and let it
    write the graph's logits: the head module flattens batch and sequence for the float head's tied
    Gemm (``tie_head``), which MatMulNBits does not need, and the Reshape back copied the logits
    (graph outputs do not alias): 45 us a step at batch 1, 150 at batch 8 on SmolLM2-360M int4, the
    logits bit for bit the same. Returns whether the pattern was found; export's parity check judges
    the result as it judges every graph."""
    graph = model.graph
    made = {o: n for n in graph.node for o in n.output}
    uses = _consumers(graph)
    constants = {t.name: t for t in graph.initializer}
    constants.update({n.output[0]: a.t for n in graph.node if n.op_type == "Constant"
                      for a in n.attribute if a.name == "value"})
    for mm in graph.node:
        if mm.op_type != "MatMulNBits":
            continue
        flatten, after = made.get(mm.input[0]), uses.get(mm.output[0], [])
        k = next((a.i for a in mm.attribute if a.name == "K"), None)
        if (flatten is None or flatten.op_type != "Reshape" or flatten.input[1] not in constants
                or list(numpy_helper.to_array(constants[flatten.input[1]])) != [-1, k]
                or len(uses[flatten.output[0]]) != 1 or len(after) != 1 or after[0] is None
                or after[0].op_type != "Reshape" or None not in uses.get(after[0].output[0], [])):
            continue  # None among the uses: the Reshape's output is the graph's
        mm.input[0], mm.output[0] = flatten.input[0], after[0].output[0]
        graph.node.remove(flatten)
        graph.node.remove(after[0])
        _drop_dead_nodes(graph)
        return True
    return False


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Nodes none of whose outputs any node or the graph uses (the Shape/Concat/Constant that sized
    a removed Reshape)."""
    while True:
        uses = _consumers(graph)
        dead = [n for n in graph.node if not any(o in uses for o in n.output)]
        if not dead:
            return
        for n in dead:
            graph.node.remove(n)


def fold_weight_transposes(model: onnx.ModelProto) -> int:
    """Replace ``Transpose(W)`` of an initializer used only there by W transposed, renamed
    ``W.T`` (so ``q_proj.weight.T`` is held as (in, out), the layout MatMul reads, and a reader
    of the weights by name knows to transpose it back). Returns how many were folded."""
    graph = model.graph
    folded = 0
    for node, init, users in _transposes_of_initializers(graph):
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        array = numpy_helper.to_array(init)
        if array.ndim != 2 or perm != [1, 0]:
            continue
        name = init.name + TRANSPOSED
        init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array.transpose(perm)), name))
        for user in users:
            if user is None:
                continue
            for k, value in enumerate(user.input):
                if value == node.output[0]:
                    user.input[k] = name
        if any(u is None for u in users):  # the transposed weight is itself a graph output
            graph.node.insert(list(graph.node).index(node),
                              onnx.helper.make_node("Identity", [name], [node.output[0]]))
        graph.node.remove(node)
        folded += 1
    return folded


def fuse_sibling_matmuls(model: onnx.ModelProto) -> int:
    """Merge the MatMuls that multiply one activation by constant 2-D weights (q/k/v; gate/up)
    into one MatMul on the weights concatenated along their output axis, then a Split back into
    the original outputs. Run after ``fold_weight_transposes`` (the weights in the (in, out)
    layout MatMul reads). Returns how many MatMuls were merged away.

    Why: at batch 1 a layer's time is its weight reads plus a fixed cost per kernel: ONNX
    Runtime wakes its thread pool once per parallel operator, and a narrow product (k_proj,
    v_proj: 320 columns at SmolLM2-360M) reads below the bandwidth a wide one reaches. Measured with
    tools.bench.graphs on SmolLM2-360M shapes: an int4 layer 10% faster, fp32 6% (docs/benchmarks.md).
    The values are the same products, and MatMul + Split is plain ONNX: TensorRT parses it, and
    the torch backend reads the parts back by name (runtime.artifact.manifest.split_fused)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is not None and len(weight.dims) == 2:
            groups.setdefault(node.input[0], []).append(node)
    merged = 0
    for x, nodes in groups.items():
        weights = [inits[n.input[1]] for n in nodes]
        if len(nodes) < 2 or len({(w.dims[0], w.data_type) for w in weights}) != 1 \
                or len({w.name for w in weights}) != len(weights):
            continue
        arrays = [numpy_helper.to_array(w) for w in weights]
        name = FUSED.join(w.name for w in weights)
        widths = [a.shape[1] for a in arrays]
        graph.initializer.extend([numpy_helper.from_array(np.concatenate(arrays, axis=1), name),
                                  numpy_helper.from_array(np.array(widths, np.int64), name + WIDTHS)])
        at = min(list(graph.node).index(n) for n in nodes)  # before every consumer of any output
        fused = name + "/output"
        for n in nodes:
            graph.node.remove(n)
        for w in weights:
            graph.initializer.remove(w)
        graph.node.insert(at, onnx.helper.make_node("Split", [fused, name + WIDTHS],
                                                    [n.output[0] for n in nodes], axis=-1, name=name + "/Split"))
        graph.node.insert(at, onnx.helper.make_node("MatMul", [x, name], [fused], name=name + "/MatMul"))
        merged += len(nodes) - 1
    return merged


class SharedWeights:
    """Appends initializers to one aligned file; equal tensors are stored once.

    Use as a context manager around the export of every graph, calling ``externalize`` on each
    graph before it is saved.
    """

    def __init__(self, directory: Path, name: str = WEIGHTS_FILE):
        self.name = name
        self.path = Path(directory) / name
        self._file = None
        self._offsets: dict[tuple, tuple[int, int]] = {}  # (digest, dtype, dims) -> (offset, length)

    def __enter__(self) -> "SharedWeights":
        self._file = open(self.path, "wb")
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def _write(self, data: bytes) -> int:
        offset = self._file.tell()
        pad = -offset % ALIGNMENT
        self._file.write(b"\0" * pad)
        self._file.write(data)
        return offset + pad

    def externalize(self, model: onnx.ModelProto) -> int:
        """Move every initializer of ``INLINE_LIMIT`` bytes or more into the shared file; returns
        the bytes this graph references there (shared tensors included)."""
        referenced = 0
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                raise ValueError(f"initializer {tensor.name} is already external")
            # raw_data is the bytes as stored (int4 packed two to a byte); to_array would unpack them
            data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
            if len(data) < INLINE_LIMIT:
                continue
            key = (hashlib.sha256(data).digest(), tensor.data_type, tuple(tensor.dims))
            if key not in self._offsets:
                self._offsets[key] = (self._write(data), len(data))
            offset, length = self._offsets[key]
            for kind in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                         "uint64_data", "string_data"):
                tensor.ClearField(kind)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for k, v in (("location", self.name), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = k, v
            referenced += length
        return referenced
