"""Version-dependent TensorRT choices as pure functions of the version string (tested without it).

What differs between the versions we target (JetPack 5: 8.5.2, JetPack 6.0: 8.6.2, JetPack 6.1/6.2:
10.3, x86: current 10.x):

- tensor-name API (num_io_tensors, set_input_shape, set_tensor_address, execute_async_v3): newer
  than 8.5.0.9 (Polygraphy switches to it there); the binding-index API is gone in 10.0. We use
  only the name API, so 8.5.1 is the minimum.
- ``NetworkDefinitionCreationFlag.EXPLICIT_BATCH``: required for ONNX on 8.x, deprecated and
  ignored in 10.x (networks are always explicit batch).
- ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``: 10.x (from 9.x); the ONNX's own types and
  casts fix every tensor's precision and precision builder flags are not allowed. 11.x builds only
  strongly typed networks (the flag is kept but ignored; BuilderFlag.FP16 is gone).
- ``BuilderFlag.FP16`` (weak typing): 8.x and 10.x. Layer precisions only bind with
  ``BuilderFlag.OBEY_PRECISION_CONSTRAINTS`` (8.2+).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .errors import EngineConfigError, TensorRTVersionError

MIN_VERSION = (8, 5, 1)  # first release past 8.5.0.9 with the full tensor-name API
STRONGLY_TYPED_FROM = 10  # use a strongly typed network for fp16 ONNX from this major version
ONLY_STRONGLY_TYPED_FROM = 11  # the builder accepts nothing else from this major version


def parse_version(text: str) -> tuple[int, ...]:
    """"8.6.2.3" -> (8, 6, 2, 3); "10.3.0.post1" -> (10, 3, 0)."""
    parts = []
    for piece in str(text).split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    if not parts:
        raise TensorRTVersionError(f"cannot read a TensorRT version from {text!r}")
    return tuple(parts)


def check_supported(version: str) -> tuple[int, ...]:
    parsed = parse_version(version)
    if parsed < MIN_VERSION:
        raise TensorRTVersionError(
            f"TensorRT {version} is too old: this toolkit needs TensorRT 8.5.1 or newer (its "
            f"tensor-name execution API); JetPack 5.1 ships 8.5.2, JetPack 6 ships 8.6.2 or 10.3; "
            f"upgrade JetPack, or on x86 pip install tensorrt")
    return parsed


@dataclass(frozen=True)
class NetworkPlan:
    """How to create the network and configure the builder for one TensorRT version."""

    precision: str  # what the engine computes in: "fp32" or "fp16"
    explicit_batch: bool  # set NetworkDefinitionCreationFlag.EXPLICIT_BATCH (8.x needs it for ONNX)
    strongly_typed: bool  # set NetworkDefinitionCreationFlag.STRONGLY_TYPED (precision from the ONNX)
    fp16_flag: bool  # set BuilderFlag.FP16 (weak typing: TensorRT may pick fp16 kernels)
    fp32_layers: bool  # pin normalization/softmax layers to fp32 + OBEY_PRECISION_CONSTRAINTS

    def to_dict(self) -> dict:
        return asdict(self)


def network_plan(version: str, onnx_dtype: str, precision: str = "fp32") -> NetworkPlan:
    """Pick network flags and builder flags for TensorRT ``version``.

    onnx_dtype: the artifact's dtype ("float32" or "float16"). An fp16 export already holds its
        fp32 islands (softmax and layer norm behind Cast nodes), so a strongly typed network
        reproduces it exactly where TensorRT offers one; an fp16 artifact always builds fp16.
    precision: "fp32" or "fp16" as asked on the command line (--fp16).
    """
    major = check_supported(version)[0]
    if precision not in ("fp32", "fp16"):
        raise EngineConfigError(f"precision must be fp32 or fp16, got {precision!r}")
    fp16 = onnx_dtype == "float16" or precision == "fp16"
    effective = "fp16" if fp16 else "fp32"
    if major >= ONLY_STRONGLY_TYPED_FROM:
        if fp16 and onnx_dtype != "float16":
            raise EngineConfigError(
                f"TensorRT {version} builds strongly typed networks only, so an fp32 ONNX export "
                f"gives an fp32 engine; for fp16 re-export with `python -m export build --dtype "
                f"fp16` and build again, or drop --fp16")
        return NetworkPlan(effective, explicit_batch=False, strongly_typed=True, fp16_flag=False,
                           fp32_layers=False)
    if major >= STRONGLY_TYPED_FROM and onnx_dtype == "float16":
        return NetworkPlan("fp16", explicit_batch=False, strongly_typed=True, fp16_flag=False,
                           fp32_layers=False)
    return NetworkPlan(effective, explicit_batch=major < 10, strongly_typed=False, fp16_flag=fp16,
                       fp32_layers=fp16)


# Layer types TensorRT's ONNX parser gives LayerNormalization (8.6+) and Softmax.
_FP32_TYPES = {"NORMALIZATION", "SOFTMAX"}
# Elementwise pieces a decomposed layer norm is made of, recognised by the ONNX node name.
_DECOMPOSED_TYPES = {"REDUCE", "ELEMENTWISE", "UNARY"}
_NORM_NAMES = ("layer_norm", "layernorm")


def keep_fp32(layer_type: str, layer_name: str) -> bool:
    """Whether a weakly typed fp16 build must pin this layer to fp32.

    LayerNorm in fp16 overflows in TensorRT and OPT's softmax overflows in fp16 from 1.3B up
    (docs/design.md section 2). ``layer_type`` is ``trt.LayerType`` member's name.
    """
    if layer_type in _FP32_TYPES:
        return True
    name = layer_name.lower()
    return layer_type in _DECOMPOSED_TYPES and any(n in name for n in _NORM_NAMES)
