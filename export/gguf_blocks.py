"""A quantized GGUF's own blocks carried into the artifact's MatMulNBits weights, not requantized.

transformers dequantizes a GGUF's tensors to float, and the export traces those floats. Quantizing
them again to MatMulNBits' grid (its own scale and zero point per block) moves every weight of a
Q4_1 file: the grid ``d * q + m`` has a minimum that is no whole number of steps from zero, which
an integer zero point cannot hold (next-token top-1 agreement with the float export: 0.63 over 194
prompts on SmolLM2-135M-Instruct's Q4_1 file). Here each constant MatMul of a graph is matched,
column by column, to the file's rows (by the exact float values transformers made of them: no
tensor names, so q/k's permutation and the fused q/k/v products need no rules), and written from
the blocks themselves:

* Q4_0 (``d * (q - 8)``): MatMulNBits with the file's scales and no zero points (MatMulNBits' default
  zero point is 8): the same weights.
* Q4_1 (``d * q + m``): MatMulNBits with the file's scales and zero points 0, plus the minimums'
  term ``sum over blocks of m * (the block's sum of x)``: x's block sums (Reshape, ReduceSum) times
  the minimums (K/32, N), added: plain ONNX that every runtime runs (runtime.artifact.manifest.MINS names its
  nodes; this project's int4 kernel folds it into its own product).
* Q8_0 (``d * q``): 8-bit MatMulNBits with zero point 128 (its default) and q + 128; Q5_0
  (``d * (q - 16)``) likewise with q + 112, Q5_1 (``d * q + m``) at 8 bits as Q4_1 is at 4 (what
  llama.cpp's Q4_K_M falls back to for a matrix of a width no multiple of 256).
* The K-quants, per sub-block (the super-block's scale times the sub-block's 6 or 8 bits, in
  float32 as gguf computes it): Q4_K (``s * q - m``) as Q4_1; Q5_K likewise at 8 bits (levels
  0..31); Q6_K (``s * (q - 32)``, sub-blocks of 16) 8-bit MatMulNBits of block_size 16. A product
  of mixed types (Q4_K_M's q and k beside a Q6_K v) is a product per run of columns of one type,
  concatenated, under ``--weights auto`` (``BlockIndex.own_widths``), else requantized. This project's int4 kernel
  keeps scales and minimums in float16: the file's exactly for Q4_0/Q4_1/Q8_0, within 2^-11 for a
  K-quant's products of two scales (ONNX Runtime's MatMulNBits keeps them in float32).

A product is carried when every one of its columns is found in blocks of the bit width its graph's
weights ask for (int4: Q4_0, Q4_1, Q4_K; int8: Q8_0, Q5_K, Q6_K), or under ``--weights auto`` of any
carried type (the file's own precision per tensor: a Q4_K_M file's Q6_K ffn_down at 8 bits in an
int4 export), and the rebuilt weights equal the traced ones; anything else is quantized as before
(``quantize.quantize_graph``). An export with
another ``--block-size`` than GGML's 32 requantizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.artifact.manifest import LEVELS, MINIMUMS, MINS, PART, SCALES, minimums_term

GGML_BLOCK = 32
CONCAT = "/concat"  # a product carried as runs of columns (PART): BASE/part0 ..., joined by BASE/concat
# the GGML types carried: (MatMulNBits bits, weights per scale, whether the blocks have minimums)
TYPES = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q8_0": (8, 32, False), "Q5_0": (8, 32, False),
         "Q5_1": (8, 32, True), "Q4_K": (4, 32, True), "Q5_K": (8, 32, True), "Q6_K": (8, 16, False)}


@dataclass
class Rows:
    """One GGUF tensor's blocks, decoded as MatMulNBits reads them: per block of ``block`` weights,
    levels ``q`` and a scale ``d``, and where the type has them a minimum ``m``:
    w = d * (q - z) + m, z MatMulNBits' default zero point (8 at 4 bits, 128 at 8) where the type
    has no minimums, else 0 (its zero points written as 0)."""
    ggml_type: str
    q: np.ndarray  # (R, nb, block) uint8
    d: np.ndarray  # (R, nb) float32 (the file's float16, or a K-quant's super-block scale times its 6 or 8 bits)
    m: np.ndarray | None  # (R, nb) float32, or None

    @property
    def bits(self) -> int:
        return TYPES[self.ggml_type][0]

    @property
    def block(self) -> int:
        return TYPES[self.ggml_type][1]


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> (...) float32 of the float16 they hold."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def decode(ggml_type: str, raw: np.ndarray) -> Rows:
    """The blocks of ``raw`` (rows, bytes per row) uint8, GGML's layout, as Rows (the arithmetic of
    gguf's quants.py, so that dequantize gives its floats bit for bit)."""
    R = raw.shape[0]
    if ggml_type in ("Q5_0", "Q5_1"):  # d, (m,) then each weight's fifth bit (qh), then its low nibble
        blocks = raw.reshape(R, -1, 22 if ggml_type == "Q5_0" else 24)  # (R, nb, bytes)
        d = _f16(blocks[..., :2])
        m = _f16(blocks[..., 2:4]) if ggml_type == "Q5_1" else None
        qh = np.ascontiguousarray(blocks[..., -20:-16]).view(np.uint32)  # (R, nb, 1): bit j of weight j
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # (R, nb, 32)
        qs = blocks[..., -16:]  # weight j in the low nibble of byte j, j + 16 in the high one
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (high << 4)  # (R, nb, 32): 0..31
        # Q5_0's d * (q - 16) at 8 bits: levels q - 16 + 128 against the default zero point 128
        return Rows(ggml_type, q + 112 if m is None else q, d, m)
    if ggml_type in ("Q4_0", "Q4_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[ggml_type]
        blocks = raw.reshape(R, -1, size)  # (R, nb, bytes)
        d = _f16(blocks[..., :2])  # (R, nb)
        if ggml_type == "Q8_0":
            q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # (R, nb, 32)
            return Rows(ggml_type, q, d, None)
        m = _f16(blocks[..., 2:4]) if ggml_type == "Q4_1" else None
        qs = blocks[..., size - 16:]  # (R, nb, 16): weight j in the low nibble of byte j, j + 16 in the high one
        return Rows(ggml_type, np.concatenate([qs & 0x0F, qs >> 4], axis=-1), d, m)
    import gguf

    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[ggml_type]
    sb = raw.reshape(-1, size)  # (R * ns, bytes): super-blocks of 256 weights
    if ggml_type == "Q6_K":
        ql, qh = sb[:, :128], sb[:, 128:192]
        scales = sb[:, 192:208].view(np.int8).astype(np.float32)  # (R ns, 16)
        d = _f16(sb[:, 208:210])[:, None] * scales  # (R ns, 16)
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)) + 96  # (R ns, 8, 32): q - 32 + 128
        return Rows(ggml_type, q.reshape(R, -1, 16).astype(np.uint8), d.reshape(R, -1), None)
    d, dmin = _f16(sb[:, 0:2]), _f16(sb[:, 2:4])  # (R ns,)
    sc, mn = gguf.quants.Q4_K.get_scale_min(sb[:, 4:16])  # (R ns, 8) each
    qs = sb[:, 16:144] if ggml_type == "Q4_K" else sb[:, 48:176]
    q = ((qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
    if ggml_type == "Q5_K":
        qh = (sb[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
        q = q | (qh << 4)
    scale = (d[:, None] * sc.astype(np.float32)).reshape(R, -1)  # (R, nb)
    minimum = -(dmin[:, None] * mn.astype(np.float32)).reshape(R, -1)
    return Rows(ggml_type, q.reshape(R, -1, 32).astype(np.uint8), scale, minimum)


def dequantize(rows: Rows) -> np.ndarray:
    """(R, nb * block) float32: what gguf's dequantize makes of the blocks."""
    levels = rows.q.astype(np.float32)
    if rows.m is None:
        w = rows.d[..., None] * (levels - (8 if rows.bits == 4 else 128))
    else:
        w = rows.d[..., None] * levels + rows.m[..., None]
    return w.reshape(w.shape[0], -1)


@dataclass
class BlockIndex:
    """The file's rows of the carried types, found by their float values."""
    tensors: list[Rows] = field(default_factory=list)
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # hash of a row's floats -> (tensor, row)
    carried: list[str] = field(default_factory=list)  # the weights written from the blocks, as an export goes
    types: dict[str, int] = field(default_factory=dict)  # products carried per GGML type ("Q4_K+Q6_K": in runs)
    requantized: list[str] = field(default_factory=list)  # the quantized weights the file's blocks did not give
    head_type: str | None = None  # the GGML type of the head's matrix (output.weight, else the tied token_embd.weight)
    embedding: str | None = None  # the embedding graph's table, once carried from 8-bit blocks (carry_embedding)
    # --weights auto: every product at the file's own widths (runs), a Q4_K_M file's 8-bit Q6_K parts
    # too; else only products wholly of the export's bit width (find)
    own_widths: bool = False

    @classmethod
    def from_gguf(cls, path) -> "BlockIndex":
        import gguf

        index = cls()
        tensors = gguf.GGUFReader(Path(path)).tensors
        heads = {t.name: t.tensor_type.name for t in tensors if t.name in ("output.weight", "token_embd.weight")}
        index.head_type = heads.get("output.weight", heads.get("token_embd.weight"))
        for tensor in tensors:
            name = tensor.tensor_type.name
            if name not in TYPES or tensor.data.ndim != 2 or int(tensor.shape[0]) % TYPES[name][1]:
                continue
            rows = decode(name, np.asarray(tensor.data))
            floats = dequantize(rows)
            t = len(index.tensors)
            index.tensors.append(rows)
            for r in range(floats.shape[0]):
                index.where.setdefault(hash(floats[r].tobytes()), (t, r))
        return index

    @property
    def head_bits(self) -> int | None:
        """The MatMulNBits bits the head's type is carried at (None: a type not carried)."""
        return TYPES[self.head_type][0] if self.head_type in TYPES else None

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def find(self, weight: np.ndarray, bits: int) -> Rows | None:
        """The blocks of ``weight`` (K, N) float32, a graph's MatMul weight (its columns are the
        file's rows), when every column is a row of one type of ``bits`` bits (or of Q4_0 and Q4_1
        both) and the blocks give back exactly ``weight``; else None."""
        found = self._found(weight)
        if found is None or any(self.tensors[t].bits != bits for t, _ in found):
            return None
        return self._gather(found, np.ascontiguousarray(weight.T))

    def runs(self, weight: np.ndarray) -> list[Rows] | None:
        """``weight``'s columns as runs of one type each, in order (a Q4_K_M file's fused q/k/v: the
        Q4_K rows of q and k, then v's Q6_K ones), when every column is a row of a carried type and
        each run's blocks give back exactly its columns; else None."""
        found = self._found(weight)
        if found is None:
            return None
        columns, runs, start = np.ascontiguousarray(weight.T), [], 0
        kinds = [_kind(self.tensors[t].ggml_type) for t, _ in found]
        for end in range(1, len(found) + 1):
            if end == len(found) or kinds[end] != kinds[start]:
                rows = self._gather(found[start:end], columns[start:end])
                if rows is None:
                    return None
                runs.append(rows)
                start = end
        return runs

    def _found(self, weight: np.ndarray) -> list[tuple[int, int]] | None:
        """(tensor, row) of each of ``weight``'s columns, or None where one is not the file's."""
        if weight.dtype != np.float32 or weight.ndim != 2:
            return None
        found = [self.where.get(hash(c.tobytes())) for c in np.ascontiguousarray(weight.T)]
        return None if any(f is None for f in found) else found

    def _gather(self, found: list[tuple[int, int]], columns: np.ndarray) -> Rows | None:
        """The file's rows ``found`` as one Rows, when they are of one kind (``_kind``) and give
        back exactly ``columns`` (N, K)."""
        parts = [self.tensors[t] for t, _ in found]
        rows = [r for _, r in found]
        types = {p.ggml_type for p in parts}
        if len({_kind(t) for t in types}) > 1:
            return None  # (Q4_K_M's q/k in Q4_K beside a Q6_K v: no one MatMulNBits holds both; runs splits them)
        q = np.stack([p.q[r] for p, r in zip(parts, rows)])  # (N, nb, block)
        d = np.stack([p.d[r] for p, r in zip(parts, rows)])  # (N, nb)
        ggml_type = _kind(types.pop()) if len(types) > 1 else types.pop()
        # Q4_0's rows beside Q4_1's: minimums -8 d, levels as they are
        m = np.stack([p.m[r] if p.m is not None else -8 * p.d[r] for p, r in zip(parts, rows)]) \
            if TYPES[ggml_type][2] else None
        out = Rows(ggml_type, q, d, m)
        return out if np.array_equal(dequantize(out), columns) else None


def _kind(ggml_type: str) -> str:
    """Types one MatMulNBits product holds together: Q4_0 beside Q4_1 (as minimums -8 d), Q5_0 beside
    Q8_0 (both 8-bit levels against zero point 128), else one."""
    return {"Q4_0": "Q4_1", "Q5_0": "Q8_0"}.get(ggml_type, ggml_type)


def carry(proto, index: BlockIndex, bits: int, accuracy_level: int) -> list[str]:
    """Replace each constant MatMul of ``proto`` whose weight ``index`` holds in blocks of ``bits``
    bits (``index.own_widths``: in blocks of any carried type, a run of columns per type) by
    MatMulNBits on those blocks (and, for a type with minimums, the minimums' term; several runs
    concatenated); returns the weights carried. The rest are left for the quantizer."""
    from onnx import helper, numpy_helper

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    # x's rank, for a minimums' term: shape inference once, before the graph holds com.microsoft's
    # nodes (for which it has no opset)
    ranks = _ranks(proto) if any(t.m is not None for t in index.tensors) else {}
    carried = []
    for node in list(graph.node):
        if node.op_type != "MatMul" or len(node.input) != 2 or node.input[1] not in inits:
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        runs = index.runs(weight) if index.own_widths else [index.find(weight, bits)]
        if runs is None or runs[0] is None:
            continue
        if any(r.m is not None for r in runs) and not ranks.get(node.input[0]):
            continue  # (a minimums' term needs x's rank; shape inference gives it for every export graph)
        name, base = node.input[1], node.name or f"{node.input[1]}/MatMulNBits"
        nodes, new = [], []
        outs = [node.output[0]] if len(runs) == 1 else [f"{base}{PART}{i}" for i in range(len(runs))]
        for i, (rows, out) in enumerate(zip(runs, outs)):
            tag = name if len(runs) == 1 else f"{name}_part{i}"  # product_weight reads it back
            nodes += _carried_product(node.input[0], weight.shape[0], rows, tag,
                                      base if len(runs) == 1 else f"{base}{PART}{i}", out, ranks, accuracy_level, new)
        if len(runs) > 1:
            nodes.append(helper.make_node("Concat", outs, [node.output[0]], name=f"{base}{CONCAT}", axis=-1))
        at = list(graph.node).index(node)
        graph.node.remove(node)
        for k, n in enumerate(nodes):
            graph.node.insert(at + k, n)
        graph.initializer.remove(inits.pop(name))
        graph.initializer.extend(new)
        inits.update({t.name: t for t in new})
        carried.append(name)
        kind = "+".join(r.ggml_type for r in runs)
        index.types[kind] = index.types.get(kind, 0) + 1
    return carried


def _carried_product(x: str, K: int, rows: Rows, tag: str, product_name: str, out: str, ranks, accuracy_level: int,
                     new: list) -> list:
    """The nodes of one MatMulNBits product of x (..., K) on ``rows``' blocks, giving ``out`` (with
    its minimums' term where the type has them); its initializers, named after ``tag``, go to ``new``."""
    from onnx import helper, numpy_helper

    bits, N, nb = rows.bits, rows.q.shape[0], K // rows.block
    if bits == 4:
        b = (rows.q[..., 0::2] | (rows.q[..., 1::2] << 4)).astype(np.uint8)  # (N, nb, block/2): MatMulNBits' order
    else:
        b = rows.q  # (N, nb, block)
    mine = [numpy_helper.from_array(b, f"{tag}_Q{bits}"), numpy_helper.from_array(rows.d.reshape(-1), f"{tag}_scales")]
    inputs = [x, mine[0].name, mine[1].name]
    if rows.m is not None:  # levels against zero: the minimums come in their own term
        zero = np.zeros(N * ((nb + 1) // 2 if bits == 4 else nb), np.uint8)  # 4 bits: two a byte
        mine.append(numpy_helper.from_array(zero, f"{tag}_zero_points"))
        inputs.append(mine[2].name)
    product = out if rows.m is None else f"{product_name}/nbits"
    nodes = [helper.make_node("MatMulNBits", inputs, [product], name=product_name, domain="com.microsoft", K=K, N=N,
                              bits=bits, block_size=rows.block, accuracy_level=accuracy_level)]
    if rows.m is not None:
        nodes += _mins_nodes(product_name, x, ranks[x], product, out, rows.m, rows.block, mine)
    new += mine
    return nodes


def carry_embedding(proto, index: BlockIndex) -> str | None:
    """Replace the float table of the embedding graph ``proto`` (``Gather(table, input_ids)``) by the
    file's own 8-bit blocks of it, gathered and dequantized in the graph: w = d * (q - 128), or
    d * q + m for a type with minimums (Q5_K); returns the table's name, or None where the file holds
    it in no 8-bit type (it stays float). The levels (V, nb, block) uint8 and the scales (V * nb,)
    are the bytes a carried 8-bit head writes (``carry``), so a tied head and embedding share them in
    the artifact's weights file: a quarter of the float table's bytes on disk and none in memory
    until rows are looked up (runtime.artifact.embed_table)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits]
    if len(gathers) != 1:
        return None
    node = gathers[0]
    name, ids = node.input
    table = numpy_helper.to_array(inits[name])
    rows = index.find(np.ascontiguousarray(table.T), 8) if table.ndim == 2 else None
    if rows is None:
        return None
    V, nb = rows.d.shape
    new = [numpy_helper.from_array(rows.q, name + LEVELS),  # (V, nb, block)
           numpy_helper.from_array(rows.d.reshape(-1), name + SCALES),  # (V * nb,): the head's layout
           numpy_helper.from_array(np.array([V, nb], np.int64), f"{name}/per_row"),
           numpy_helper.from_array(np.array([-1], np.int64), f"{name}/last"),
           numpy_helper.from_array(np.array([0, 0, -1], np.int64), f"{name}/rows")]
    p = f"{name}/blocks"

    def per_block(source: str, out: str) -> list:  # (V * nb,) -> gathered (B, T, nb, 1)
        return [helper.make_node("Reshape", [source, f"{name}/per_row"], [f"{out}/table"]),
                helper.make_node("Gather", [f"{out}/table", ids], [f"{out}/rows"]),
                helper.make_node("Unsqueeze", [f"{out}/rows", f"{name}/last"], [out])]

    nodes = [helper.make_node("Gather", [name + LEVELS, ids], [f"{p}/q"]),  # (B, T, nb, block)
             helper.make_node("Cast", [f"{p}/q"], [f"{p}/levels"], to=TensorProto.FLOAT),
             *per_block(name + SCALES, f"{p}/d")]
    if rows.m is None:  # d * (q - 128), as dequantize computes it
        new.append(numpy_helper.from_array(np.array(128, np.float32), f"{name}/zero"))
        nodes += [helper.make_node("Sub", [f"{p}/levels", f"{name}/zero"], [f"{p}/centred"]),
                  helper.make_node("Mul", [f"{p}/d", f"{p}/centred"], [f"{p}/w"])]
    else:  # d * q + m
        new.append(numpy_helper.from_array(rows.m.reshape(-1), name + MINIMUMS))
        nodes += [*per_block(name + MINIMUMS, f"{p}/m"),
                  helper.make_node("Mul", [f"{p}/d", f"{p}/levels"], [f"{p}/dq"]),
                  helper.make_node("Add", [f"{p}/dq", f"{p}/m"], [f"{p}/w"])]
    nodes.append(helper.make_node("Reshape", [f"{p}/w", f"{name}/rows"], [node.output[0]]))  # (B, T, D)
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for k, n in enumerate(nodes):
        graph.node.insert(at + k, n)
    graph.initializer.remove(inits[name])
    graph.initializer.extend(new)
    index.embedding = name
    return name


def _ranks(proto) -> dict[str, int]:
    """Each value's rank where ONNX's shape inference finds it."""
    from onnx import shape_inference

    inferred = shape_inference.infer_shapes(proto).graph
    return {v.name: len(v.type.tensor_type.shape.dim) for v in [*inferred.input, *inferred.value_info]
            if v.type.tensor_type.HasField("shape")}


def _mins_nodes(product_name: str, x: str, rank: int, product: str, out: str, m: np.ndarray, block: int,
                new: list) -> list:
    """out = product + (x's block sums) @ m.T: the minimums' ``m * sum(x)`` over each block. x (..., K)
    is reshaped to (..., nb, block) (Reshape's 0s keep the leading dimensions) and summed over its blocks."""
    from onnx import helper, numpy_helper

    nb = m.shape[1]
    p = f"{product_name}{MINS}"
    shape = numpy_helper.from_array(np.array([0] * (rank - 1) + [nb, block], np.int64), f"{p}/shape")
    axes = numpy_helper.from_array(np.array([-1], np.int64), f"{p}/axes")
    mins = numpy_helper.from_array(np.ascontiguousarray(m.T), f"{p}/m")  # (nb, N)
    new += [shape, axes, mins]
    return [helper.make_node("Reshape", [x, shape.name], [f"{p}/blocks"], name=f"{p}/reshape"),
            helper.make_node("ReduceSum", [f"{p}/blocks", axes.name], [f"{p}/sums"], name=f"{p}/sum", keepdims=0),
            helper.make_node("MatMul", [f"{p}/sums", mins.name], [f"{p}/term"], name=f"{p}/term"),
            helper.make_node("Add", [product, f"{p}/term"], [out], name=f"{p}/add")]


def is_minimums(node) -> bool:
    """Whether ``node`` is one of a carried Q4_1 product's minimums' term (``carry``)."""
    return MINS + "/" in node.name


def product_weight(initializer: str) -> str:
    """The float weight a MatMulNBits' packed initializer stands for: its name less the quantizer's
    "_Q4" / "_Q8" and a run's "_part0" (``carry``)."""
    return re.sub(r"(_part\d+)?_Q\d+$", "", initializer)


def product_base(name: str) -> str:
    """The product a node of ``name`` is part of: a run's ``BASE/partN`` is ``BASE``'s (``carry``)."""
    return re.sub(rf"{PART}\d+$", "", name)


def product_nodes(graph, node) -> list:
    """``node``, a product of a graph, with the nodes of its minimums' term (``carry``) after it, in
    order; a run's (``BASE/partN``): every run of its product, each with its term, and their Concat."""
    base = product_base(node.name)
    if base == node.name:
        return [node] + minimums_term(graph.node, node.name)
    return [n for n in graph.node if n.name.startswith(f"{base}{PART}") or n.name == f"{base}{CONCAT}"]


__all__ = ["BlockIndex", "GGML_BLOCK", "LEVELS", "MINIMUMS", "Rows", "SCALES", "TYPES", "carry", "carry_embedding",
           "decode", "dequantize", "is_minimums", "product_base", "product_nodes", "product_weight"]
