"""Backends behind one small interface (see base.Backend). Heavy imports happen on first use."""

from __future__ import annotations

from .base import Backend

BACKENDS = ("onnxruntime", "torch", "tensorrt")


def create_backend(name: str, directory, manifest, **options) -> Backend:
    if name in ("onnxruntime", "ort"):
        from .onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(directory, manifest, **options)
    if name in ("torch", "pytorch"):
        from .torch import TorchBackend

        return TorchBackend(directory, manifest, **options)
    if name in ("tensorrt", "trt"):
        from .tensorrt import TensorRTBackend

        return TensorRTBackend(directory, manifest, **options)
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


__all__ = ["Backend", "BACKENDS", "create_backend"]
