"""Backends behind one small interface (see base.Backend). Heavy imports happen on first use.

The ONNX Runtime and torch backends live here; ``onnxruntime`` with a ``device`` (the default
when onnxruntime-gpu offers CUDA) is the IOBinding backend, which keeps the KV cache on the device.
Backends that live in other packages register under the ``skipdecode_edge.backends`` entry-point
group (pyproject.toml), so ``runtime`` imports nothing from them: the TensorRT backend is
``engines.backend:TensorRTBackend``, and ``engines`` depends on ``runtime``, never the reverse.
"""

from __future__ import annotations

from ..errors import SkipDecodeError, UnknownBackendError
from .base import Backend

BACKENDS = ("onnxruntime", "torch", "tensorrt")
ENTRY_POINT_GROUP = "skipdecode_edge.backends"
_ALIASES = {"ort": "onnxruntime", "pytorch": "torch", "trt": "tensorrt"}
_PROVIDERS = {"tensorrt": "engines"}  # backend -> the package of this project that provides it


class BackendNotInstalledError(SkipDecodeError, ImportError):
    """A backend that registers through an entry point, and none is installed for it."""


def entry_point_backend(name: str):
    """The backend class registered as ``name`` in the ``skipdecode_edge.backends`` group."""
    from importlib import metadata  # here, not at the top: it costs `import runtime` ~40 ms

    found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        package = _PROVIDERS.get(name)
        origin = f"the {package} package of skipdecode-edge" if package else "a package"
        raise BackendNotInstalledError(
            f"backend {name!r} is provided by {origin} through the {ENTRY_POINT_GROUP!r} entry "
            f"point, and none is registered in this environment; reinstall with pip install -e .")
    return found[0].load()


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False  # OnnxRuntimeBackend says how to install it
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def create_backend(name: str, directory, manifest, **options) -> Backend:
    """The backend ``name`` on an artifact; ``options`` are its constructor's keyword arguments,
    which are where each backend declares the options it takes (an unknown one: InvalidArgumentError)."""
    name = _ALIASES.get(name, name)
    if name == "onnxruntime":
        device = options.pop("device", None)
        if device is None and options.get("providers") is None and _ort_has_cuda():
            device = "cuda"  # onnxruntime-gpu: keep everything on the GPU unless told otherwise
        if device is not None:  # IOBinding: hidden states and KV on `device`, logits back
            from .onnxruntime_cuda import OnnxRuntimeIOBindingBackend

            return _made(name, OnnxRuntimeIOBindingBackend, directory, manifest, dict(options, device=device))
        from .onnxruntime import OnnxRuntimeBackend

        return _made(name, OnnxRuntimeBackend, directory, manifest, options, also=("device",))
    if name == "torch":
        from .torch import TorchBackend

        return _made(name, TorchBackend, directory, manifest, options)
    if name in BACKENDS:
        return _made(name, entry_point_backend(name), directory, manifest, options)
    raise UnknownBackendError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


def accepted_options(cls, also=()) -> tuple[str, ...]:
    """The options a backend class takes: its constructor's keyword arguments after the artifact."""
    import inspect

    params = list(inspect.signature(cls.__init__).parameters)[3:]  # self, directory, manifest
    return tuple(dict.fromkeys([*params, *also]))


def _made(name: str, cls, directory, manifest, options: dict, also=()) -> Backend:
    known = accepted_options(cls, also)
    unknown = sorted(set(options) - set(known))
    if unknown:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"backend {name!r} takes the options {', '.join(known)}; "
                                   f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not among them")
    return cls(directory, manifest, **options)


__all__ = ["Backend", "BACKENDS", "BackendNotInstalledError", "ENTRY_POINT_GROUP", "accepted_options", "create_backend",
           "entry_point_backend"]
