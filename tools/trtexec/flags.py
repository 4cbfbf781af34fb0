"""The trtexec flags that depend on the TensorRT version: precision and workspace. Pure functions.

Sources (checked, not guessed):
- ``--stronglyTyped``, ``--fp16``, ``--memPoolSize=poolspec`` with ``poolfmt ::= pool:size``, size in MiB
  when no suffix is given: ``trtexec --help`` of TensorRT 10.5, and NVIDIA/TensorRT
  samples/trtexec/README.md ("Example 6: Create a strongly typed plan file": builder precision flags
  are not allowed together with --stronglyTyped).
- ``--workspace=N`` replaced by ``--memPoolSize=workspace:N``: NVIDIA's "Migrating trtexec Usage from
  TensorRT 8.x to 10.x"; the memory-pool API it maps to (IBuilderConfig::setMemoryPoolLimit) is new in
  TensorRT 8.4.0 EA (TensorRT 8.4 API changes), the 8.x trtexec help reads "poolfmt ::= pool:sizeInMiB".
- TensorRT 11 removed --fp16 and every other precision flag; networks are always strongly typed and
  --stronglyTyped "is no longer needed": NVIDIA's "Migrating trtexec Usage from TensorRT 10.x to 11.x".
- Weak typing (builder precision flags) is deprecated since TensorRT 10.12 (10.12.0 release notes).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PrecisionError
from .version import TrtVersion

MEM_POOL_SINCE = TrtVersion(8, 4)  # --memPoolSize=workspace:N; older trtexec has only --workspace=N
STRONGLY_TYPED_SINCE = TrtVersion(10, 0)  # first TensorRT for Jetson/x86 whose trtexec has --stronglyTyped
WEAK_TYPING_DEPRECATED_SINCE = TrtVersion(10, 12)
PRECISION_FLAGS_REMOVED_IN = TrtVersion(11, 0)
FP16_EXPORT_HINT = "export an fp16 artifact with `python -m export build --dtype fp16` and profile that"


@dataclass(frozen=True)
class Precision:
    flags: tuple[str, ...]  # trtexec flags, possibly none
    reason: str  # one line, printed beside the command


def precision_flags(version: TrtVersion, onnx_dtype: str, fp16: bool = False) -> Precision:
    """Precision flags for a graph exported as ``onnx_dtype`` ("float16" / "float32").

    An fp16 export already says which ops run in fp32 (softmax, LayerNorm): a strongly typed network
    keeps that, while --fp16 lets the builder pick fp16 anywhere. ``fp16`` asks for fp16 kernels on an
    fp32 export (weak typing); it is implied for an fp16 export.
    """
    if onnx_dtype == "float16":
        if version >= PRECISION_FLAGS_REMOVED_IN:
            return Precision((), f"TensorRT {version} networks are always strongly typed: the fp16 ONNX "
                                 f"sets the types")
        if version >= STRONGLY_TYPED_SINCE:
            return Precision(("--stronglyTyped",),
                             "strongly typed from the fp16 ONNX: its fp32 softmax and LayerNorm stay fp32")
        return Precision(("--fp16",), f"TensorRT {version} has no --stronglyTyped: --fp16 enables the fp16 "
                                      f"kernels the ONNX asks for")
    if onnx_dtype != "float32":
        raise PrecisionError(f"ONNX dtype {onnx_dtype!r} is neither float16 nor float32; re-export the artifact")
    if not fp16:
        return Precision((), "fp32 ONNX, no precision flag: fp32 (TF32 where the GPU has it)")
    if version >= PRECISION_FLAGS_REMOVED_IN:
        raise PrecisionError(
            f"--fp16 on an fp32 artifact needs a builder precision flag, which TensorRT {version} removed "
            f"(from 11.0 networks are always strongly typed); {FP16_EXPORT_HINT}, or pass --trt-version 10.x "
            f"for an older trtexec")
    reason = "--fp16 on the fp32 ONNX (weak typing): the builder may run any layer in fp16"
    if version >= WEAK_TYPING_DEPRECATED_SINCE:
        reason += f"; deprecated since TensorRT {WEAK_TYPING_DEPRECATED_SINCE}: {FP16_EXPORT_HINT}"
    return Precision(("--fp16",), reason)


def workspace_flag(version: TrtVersion, mib: int) -> str:
    """The workspace limit, in MiB: --memPoolSize from 8.4 on (--workspace is deprecated, gone in 10)."""
    if version >= MEM_POOL_SINCE:
        return f"--memPoolSize=workspace:{mib}"
    return f"--workspace={mib}"
