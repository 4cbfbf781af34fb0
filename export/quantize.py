"""Weight-only quantization of exported graphs with ONNX Runtime's own quantizer.

Each MatMul whose weight is a constant (the layers' q/k/v/out projections and fc1/fc2, the head's
lm_head) gets its weight quantized block-wise along the input dimension K: every ``block_size``
consecutive weights of a column share one scale (and, asymmetric, one zero point). Activations,
the KV cache, layer norms and the embedding stay in the artifact's float dtype: decode at batch 1
reads every active weight once per token, so the weights are what a smaller format buys back.

Two forms of the same quantization (onnxruntime.quantization.matmul_nbits_quantizer):

* ``matmulnbits`` (default): ``com.microsoft::MatMulNBits``, int4 or int8, ONNX Runtime's fused
  dequantize-and-multiply kernel. A contrib op: no TensorRT parser imports it (export.trt_compat).
* ``qdq``: int4 only, symmetric, an opset 21 ``DequantizeLinear`` with ``block_size`` feeding a
  plain MatMul. This is the form TensorRT 10 parses for INT4 weight-only quantization: its
  Dequantize layer takes INT4 input with a 2-D (block) scale and only zero-valued zero points
  (TensorRT operator docs, "Dequantize": "a 2-D tensor for block quantization (supported for
  DataType::kINT4 only)", "The zero_point must only contain zero-valued coefficients"). ORT's
  quantizer writes no 8-bit QDQ form for MatMul ("MatMul only supports QOperator format for 8
  bits quantization"), so int8 has only the MatMulNBits form here. ONNX Runtime itself fuses this
  form back into MatMulNBits, with int8 activations unless the session sets
  ``session.qdq_matmulnbits_accuracy_level`` (export.parity sets 0).

  Which TensorRT reads it (onnx-tensorrt's source, export/trt_ops/supported_ops.json): 11.0 documents
  opset 21. 10.0-10.5 document opsets 9-20, but no parser refuses a model for its opset, and the
  10.x DequantizeLinear importer takes a scale of the input's rank with one blocked dimension as
  block quantization, never reading ``block_size``: JetPack 6's 10.3 should parse it, to be
  confirmed on the device. 8.x has no INT4 type. An opset <= 20 form is not possible: before 21,
  ONNX's DequantizeLinear takes neither INT4 nor blocked scales, so ONNX Runtime (the export's
  parity check, and the CPU runtime) would refuse the graph. ``build`` prints this verdict
  (``tensorrt_readers``) before any work.

The graphs are exported without constant folding, so a Linear's weight reaches its MatMul through
a Transpose node; the quantizer only takes initializers, so those Transposes are folded first.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from runtime.artifact.manifest import WEIGHT_FORMATS as WEIGHTS, WIDTHS, split_fused
from runtime.errors import InvalidArgumentError

from .gguf_blocks import GGML_BLOCK, carry, is_minimums, product_nodes, product_weight


QUANT_BITS = {"int8": 8, "int4": 4}
# Weights per quantization scale along K: ONNX Runtime's quantizer CLI default, and what keeps int4
# within ~1 BLEU on the demo model (docs/quality.md). Every default block size of export, plan and
# tools.bench is this one.
BLOCK_SIZE = 32
FORMATS = ("matmulnbits", "qdq")
# What QuantConfig's 0 picks: float activations, so that a row's products do not depend on what else
# a call carries (int8 activations turn the attention's float noise, which differs with a call's
# rows, into other tokens: docs/design.md, "Batch invariance") and a GGUF's carried blocks give the
# file's values exactly (docs/quality.md, "The GGUF's own blocks"). This project's kernel computes
# them with 16-bit activations (runtime/platform/kernels: decode within ~5% of int8 activations,
# prompts ~1.45x slower); where only MatMulNBits runs (its float path 1.2x-9x slower at 4 bits,
# 20x-40x at 8), the runtime runs them at int8 activations (level 4) unless loaded with deterministic=True.
DEFAULT_ACCURACY_LEVEL = 1


@dataclass
class QuantConfig:
    weights: str = "float"  # the layers' weights: float (as exported), int8 or int4
    head_weights: str | None = None  # the head's; None: as ``weights``. The embedding stays float:
    # a step reads one row of it, so quantizing it saves memory but no bandwidth
    block_size: int = BLOCK_SIZE  # weights per scale along K; must divide every K (hidden, ffn)
    format: str = "matmulnbits"  # or "qdq": opset 21 blocked DequantizeLinear, for TensorRT 10+
    accuracy_level: int = 0  # MatMulNBits' activation precision: 0 = DEFAULT_ACCURACY_LEVEL (1,
    # float); 1 = the activations' float type, 2 fp16, 3 bf16, 4 int8 (ONNX Runtime's fast CPU kernels)

    def __post_init__(self) -> None:
        if self.head_weights is None:
            self.head_weights = self.weights
        for flag, value in (("weights", self.weights), ("head_weights", self.head_weights)):
            if value not in WEIGHTS:
                raise InvalidArgumentError(f"{flag} must be one of {', '.join(WEIGHTS)}, got {value!r}")
        if self.format not in FORMATS:
            raise InvalidArgumentError(f"weights format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.format == "qdq" and "int8" in (self.weights, self.head_weights):
            raise InvalidArgumentError(
                "the qdq weights format is int4 only (ONNX Runtime's quantizer writes 8-bit MatMul "
                "weights only as MatMulNBits); use --weights int4, or the matmulnbits format for int8")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            # MatMulNBits takes power-of-two blocks of at least 16
            raise InvalidArgumentError(f"block_size must be a power of two >= 16, got {bs!r}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise InvalidArgumentError(f"accuracy_level must be 0 to 4, got {self.accuracy_level!r}")

    @property
    def quantized(self) -> bool:
        return self.weights != "float" or self.head_weights != "float"

    def for_graph(self, name: str) -> str:
        """The weights of graph ``name``: "float", "int8" or "int4"."""
        if name == "embed":
            return "float"
        return self.head_weights if name == "head" else self.weights

    def check_sizes(self, hidden_size: int, ffn_dim: int, embed_dim: int | None,
                    attention: int | None = None) -> None:
        """Every quantized MatMul's K must be whole blocks: hidden (q/k/v/out, fc1, OPT-350m's
        project_out), ffn (fc2, down_proj), the embedding width (lm_head; None: the head stays
        float), the attention width heads x head_dim (o_proj; Qwen3's differs from hidden).
        Checked before any export."""
        sizes = [("hidden size", hidden_size), ("ffn dim", ffn_dim)]
        if embed_dim is not None:
            sizes.append(("embedding width", embed_dim))
        if attention is not None and attention != hidden_size:
            sizes.append(("attention width (heads x head_dim)", attention))
        bad = [f"{n} {k}" for n, k in sizes if k % self.block_size]
        if bad:
            common = math.gcd(*(k for _, k in sizes))
            fit = common & -common  # the largest power of two that divides every size
            fix = (f"pass --block-size {fit} (or a smaller power of two >= 16)" if fit >= 16 else
                   f"no block size of 16 or more divides them all (their largest common power of two is "
                   f"{fit}): this model's weights cannot be quantized block-wise; export them as float")
            raise InvalidArgumentError(
                f"block_size {self.block_size} does not divide the model's {' and '.join(bad)}: "
                f"weight-only quantization needs whole blocks along each weight's input dimension; {fix}")

    def manifest_entry(self) -> dict:
        """The manifest's ``weights`` field (empty: float weights, as manifests before it)."""
        if not self.quantized:
            return {}
        return {"embed": "float", "layers": self.weights, "head": self.head_weights,
                "block_size": self.block_size, "format": self.format,
                "accuracy_level": self.accuracy_level}


def tensorrt_verdicts(config: QuantConfig) -> dict[str, tuple[str, str]]:
    """Per TensorRT version of export/trt_ops/supported_ops.json, whether its ONNX parser reads the
    weights ``config`` writes: ("parses" | "confirm" | "cannot", reason). export.trt_compat's
    verdict on a one-MatMul graph quantized exactly as the export quantizes (same quantizer, format
    and bits); "confirm": only past the opset range its documents state."""
    from onnx import TensorProto, helper, numpy_helper

    from .trt_compat import check_model

    bits = config.weights if config.weights != "float" else config.head_weights
    k = config.block_size * 2
    weight = numpy_helper.from_array(np.linspace(-1, 1, k * 8, dtype=np.float32).reshape(k, 8), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="probe")], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [weight])
    probe = quantize_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), bits,
                           config.block_size, config.format, config.accuracy_level)
    opset = next(o.version for o in probe.opset_import if o.domain in ("", "ai.onnx"))
    order = {"type": 0, "domain": 1, "operator": 2}  # the most basic reason first; the opset last
    verdicts = {}
    for version, findings in check_model(probe, "probe", versions="all").items():
        errors = sorted((f for f in findings if f.severity == "error"), key=lambda f: order.get(f.kind, 3))
        if errors:
            verdicts[version] = ("cannot", errors[0].detail.split(" (")[0].split(";")[0])
        elif any(f.kind == "opset" for f in findings):
            verdicts[version] = ("confirm", f"opset {opset} is past the range its documents state")
        else:
            verdicts[version] = ("parses", "")
    return verdicts


def tensorrt_readers(config: QuantConfig, artifact: str = "ARTIFACT") -> str:
    """``tensorrt_verdicts`` in one line, for ``export build`` to say before any work."""
    from .trt_compat import load_support

    platforms = load_support().versions
    verdicts = tensorrt_verdicts(config)
    named = {v: v + "".join(f" ({p.split(' (')[0]})" for p in platforms[v].data.get("platforms", [])[:1])
             for v in verdicts}
    group = lambda kind: [named[v] for v, (k, _) in verdicts.items() if k == kind]  # noqa: E731
    cannot: dict[str, list[str]] = {}
    for v, (kind, why) in verdicts.items():
        if kind == "cannot":
            cannot.setdefault(why, []).append(v)
    bits = config.weights if config.weights != "float" else config.head_weights
    what = f"{bits} weights as {config.format}"
    if not group("parses") and not group("confirm"):
        reasons = "; ".join(f"{', '.join(vs)}: {why}" for why, vs in cannot.items())
        return (f"TensorRT: no version's parser reads {what} ({reasons}): this artifact is for ONNX Runtime; "
                f"for TensorRT 10+ export int4 with --quant-format qdq, or --weights float")
    parts = []
    if group("parses"):
        parts.append(f"TensorRT {', '.join(group('parses'))} parses them")
    confirm = [(named[v], why) for v, (k, why) in verdicts.items() if k == "confirm"]
    if confirm:
        parts.append(f"{', '.join(n for n, _ in confirm)} should, by its parser's source, though "
                     f"{confirm[0][1]}: confirm on the device with `python -m tools.trtexec {artifact} "
                     f"--graph layer_00 --run`")
    for why, vs in cannot.items():
        parts.append(f"{', '.join(vs)} cannot ({why})")
    return f"TensorRT and {what}: " + "; ".join(parts)


def quantize_graph(proto, weights: str, block_size: int = BLOCK_SIZE, format: str = "matmulnbits",
                   accuracy_level: int = 0, blocks=None):
    """The ``onnx.ModelProto`` ``proto`` (weights inside) with its constant MatMul weights quantized.

    ``weights`` "float" returns ``proto`` unchanged. ``blocks``: a GGUF's BlockIndex
    (export.gguf_blocks): the products it holds at this bit width are written from the file's own
    blocks (MatMulNBits form, at the file's block size), the rest quantized. Raises InvalidArgumentError when a
    MatMul's K is not a whole number of blocks (rather than leave it float without a word).
    """
    if weights == "float":
        return proto
    # validates the arguments, with the messages the CLI gives
    QuantConfig(weights=weights, block_size=block_size, format=format, accuracy_level=accuracy_level)
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer)

    from .weights import fold_weight_transposes  # onnx: `export plan` imports this module without it

    fold_weight_transposes(proto)
    bits = QUANT_BITS[weights]
    accuracy_level = accuracy_level or DEFAULT_ACCURACY_LEVEL
    if blocks and format == "matmulnbits" and block_size == GGML_BLOCK:
        blocks.carried += carry(proto, blocks, bits, accuracy_level)
    targets = _constant_matmuls(proto)
    if blocks is not None:
        blocks.requantized += [n.input[1] for n, _ in targets]
    if not targets:  # every product carried from the file
        return proto
    for node, k in targets:
        if k % block_size:
            raise InvalidArgumentError(
                f"MatMul {node.name!r} has K = {k}, not a multiple of block_size {block_size}; pass "
                f"--block-size with a power of two that divides the model's hidden and ffn sizes")
    qformat = QuantFormat.QDQ if format == "qdq" else QuantFormat.QOperator
    algo = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=format == "qdq",  # TensorRT needs zero zero points
        accuracy_level=accuracy_level or None, quant_format=qformat, op_types_to_quantize=("MatMul",),
        bits=bits)
    quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, algo_config=algo,
                                     quant_format=qformat,
                                     # carried products' minimums' terms: exact already
                                     nodes_to_exclude=[n.name for n in proto.graph.node if is_minimums(n)])
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.ERROR)  # it logs every node it visits at INFO
    try:
        quantizer.process()
    finally:
        log.setLevel(level)
    out = quantizer.model.model
    _axes_as_inputs(out)
    left = [n.name for n, _ in _constant_matmuls(out)]
    if left:  # the quantizer skips what it cannot do with a log line; here that is a bug
        raise InvalidArgumentError(f"ONNX Runtime's quantizer left MatMul(s) {left} unquantized")
    return out


# Reductions whose axes became an input at opset 18 (ReduceSum's already at 13)
_REDUCE_18 = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
              "ReduceLogSumExp", "ReduceSumSquare")


def _axes_as_inputs(proto) -> None:
    """The qdq form's opset 21 (blocked DequantizeLinear), which the quantizer sets without
    converting the graph: a reduction's ``axes`` attribute becomes its second input there, or ONNX
    Runtime refuses the graph ("Unrecognized attribute: axes for operator ReduceMean": the Llama
    family's RMSNorm)."""
    from onnx import helper, numpy_helper

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 18:
        return
    for node in proto.graph.node:
        axes = next((a for a in node.attribute if a.name == "axes"), None)
        if node.op_type in _REDUCE_18 and axes is not None:
            name = f"{node.name or node.output[0]}:axes"
            proto.graph.initializer.append(numpy_helper.from_array(np.array(helper.get_attribute_value(axes),
                                                                            np.int64), name))
            node.attribute.remove(axes)
            node.input.append(name)


def _constant_matmuls(proto) -> list[tuple]:
    """(node, K) of every MatMul whose second input is a 2-D float initializer (a carried Q4_1
    product's minimums' term aside)."""
    inits = {t.name: t for t in proto.graph.initializer}
    out = []
    for n in proto.graph.node:
        if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits and not is_minimums(n):
            dims = list(inits[n.input[1]].dims)
            if len(dims) == 2:
                out.append((n, dims[0]))
    return out


def dequantized_weights(proto, widths_from=None) -> dict[str, np.ndarray]:
    """The float weight (K, N) each quantized MatMul multiplies by, keyed by the weight's name before
    quantization (``q_proj.weight.T``; a fused one split into its parts), computed by ONNX Runtime
    itself: the node (and, in the QDQ form, its DequantizeLinear) run on an identity matrix. For
    tests that replace a reference's weights by exactly what the quantized graph uses. ``widths_from``:
    another graph (a proto) whose fused weights' widths split these (a draft layer's fused graph
    multiplies by the packed q/k/v, its plain layer graph records their widths)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from runtime.backends.onnxruntime import new_session_options

    inits = {t.name: t for t in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    out = {}
    for n in proto.graph.node:
        if n.op_type == "MatMulNBits":
            k = next(a.i for a in n.attribute if a.name == "K")
            # a product carried in runs (export.gguf_blocks.carry): the whole of it, once
            nodes, weight = product_nodes(proto.graph, n), product_weight(n.input[1])
            if weight in out:
                continue
        elif n.op_type == "MatMul" and producers.get(n.input[1], None) is not None \
                and producers[n.input[1]].op_type == "DequantizeLinear":
            dq = producers[n.input[1]]
            k = inits[dq.input[0]].dims[0]
            nodes, weight = [dq, n], dq.input[0].rsplit("_DQ_Q", 1)[0]
        else:
            continue
        a_name = n.input[0]
        dtype = np.float16 if _elem_type(proto, n) == onnx.TensorProto.FLOAT16 else np.float32
        needed = {i for m in nodes for i in m.input if i in inits}
        # a minimums' term reshapes x at its rank (gguf_blocks): the identity gets leading 1s to it
        rank = max([2] + [len(numpy_helper.to_array(inits[m.input[1]])) - 1 for m in nodes if m.op_type == "Reshape"])
        eye = np.eye(k, dtype=dtype).reshape((1,) * (rank - 2) + (k, k))
        graph = helper.make_graph(
            nodes, "dequantize", [helper.make_tensor_value_info(a_name, _elem_type(proto, n), list(eye.shape))],
            [helper.make_tensor_value_info(nodes[-1].output[0], _elem_type(proto, n), None)],
            [inits[i] for i in needed])
        model = helper.make_model(graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
        session = ort.InferenceSession(model.SerializeToString(), new_session_options(ort),
                                       providers=["CPUExecutionProvider"])
        out[weight] = session.run(None, {a_name: eye})[0].reshape(k, -1)
    sources = [*inits.values(), *(widths_from.graph.initializer if widths_from is not None else [])]
    widths = {t.name: numpy_helper.to_array(t) for t in sources if t.name.endswith(WIDTHS)}
    return split_fused({**out, **widths})


def _elem_type(proto, node) -> int:
    """The float type of ``node``'s activations: its scales' type (the quantizer keeps them in it)."""
    inits = {t.name: t for t in proto.graph.initializer}
    for i in node.input[2:3]:  # MatMulNBits: scales
        if i in inits:
            return inits[i].data_type
    producers = {o: n for n in proto.graph.node for o in n.output}
    dq = producers.get(node.input[1])
    return inits[dq.input[1]].data_type
