"""Typed errors of the trtexec tool; each message states the limit it broke and the fix."""

from __future__ import annotations

from runtime.errors import SkipDecodeError


class TrtexecError(SkipDecodeError):
    """Base class of every error this tool raises on purpose."""


class UnknownGraphError(TrtexecError, ValueError):
    """A --graph name that the artifact's manifest does not list."""


class ProfileLimitError(TrtexecError, ValueError):
    """CLI limits (batch, sequence, past, max sequence) that no optimization profile can hold."""


class PrecisionError(TrtexecError, ValueError):
    """A precision request the selected TensorRT version cannot build."""


class TrtexecNotFoundError(TrtexecError, FileNotFoundError):
    """--run without a trtexec binary on PATH, at a known location or at --trtexec."""


class TrtexecFailedError(TrtexecError, RuntimeError):
    """trtexec exited with a non-zero status."""


class TrtexecOutputError(TrtexecError, ValueError):
    """An exported times/profile JSON file that is missing or not in trtexec's format."""


class UnparsableGraphError(TrtexecError, ValueError):
    """A graph the target TensorRT's ONNX parser cannot import (export.trt_compat's check)."""
