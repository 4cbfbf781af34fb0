"""TensorRT engines from the per-layer ONNX graphs: one engine per graph, two optimization profiles
(prefill and decode), one shared timing cache, an engine manifest, atomic and resumable builds.

    python -m engines build artifacts/opt-1.3b --max-batch 8 --max-seq 1024 --workspace 2GiB

Modules: config (limits, workspace), profiles (min/opt/max per input), versions (flags per
TensorRT version), manifest (engines.json, resume and load-time checks), atomic (file writes),
device (GPU identity), build (the resumable loop), builder (the TensorRT calls), backend (the
runtime's TensorRT backend, registered as the ``skipdecode_edge.backends`` entry point
``tensorrt``: engines imports runtime, never the reverse).

TensorRT is imported lazily by builder.py and backend.py only, so the CPU-only install imports
this package and tests everything here but the TensorRT calls.
"""

from .config import EngineBuildConfig, parse_size
from .errors import (EngineBuildError, EngineConfigError, EngineLimitError, EngineMismatchError,
                     EngineRuntimeError, NoCudaDeviceError, TensorRTMissingError,
                     TensorRTVersionError)

__all__ = [
    "EngineBuildConfig", "parse_size", "EngineBuildError", "EngineConfigError", "EngineLimitError",
    "EngineMismatchError", "EngineRuntimeError", "NoCudaDeviceError", "TensorRTMissingError",
    "TensorRTVersionError",
]
