"""Typed errors of the engines package. Each message says what is wrong, the limit, and the fix.

They subclass ``runtime.errors.SkipDecodeError`` so one ``except SkipDecodeError`` catches every
error the toolkit raises on purpose.
"""

from __future__ import annotations

from runtime.errors import ArtifactError, SkipDecodeError

BUILD_COMMAND = "python -m engines build"


def rebuild_hint(artifact_dir) -> str:
    return f"rebuild with `{BUILD_COMMAND} {artifact_dir}`"


class TensorRTMissingError(SkipDecodeError, ImportError):
    """``import tensorrt`` failed: the message says how to get TensorRT for this platform."""


class TensorRTVersionError(SkipDecodeError, RuntimeError):
    """The installed TensorRT is older than the tensor-name API this toolkit uses (8.5.1)."""


class NoCudaDeviceError(SkipDecodeError, RuntimeError):
    """No CUDA GPU is visible (through PyTorch) to build or run engines on."""


class EngineConfigError(SkipDecodeError, ValueError):
    """Build limits or settings that cannot work (e.g. max_seq > max_position_embeddings)."""


class EngineBuildError(SkipDecodeError, RuntimeError):
    """TensorRT could not parse a graph or build its engine."""


class EngineMismatchError(ArtifactError):
    """Engines that do not belong here: other TensorRT version, other GPU, changed source graphs,
    missing or corrupted plans. The fix is always to rebuild (or finish) the engines."""


class EngineLimitError(SkipDecodeError, ValueError):
    """A request beyond the limits the engines were built for (batch, sequence, prompt)."""


class EngineRuntimeError(SkipDecodeError, RuntimeError):
    """TensorRT refused a shape, a profile or an execution at run time."""
