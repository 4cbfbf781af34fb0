"""The GPU engines are built for and run on, as the engine manifest records it.

A TensorRT plan is specific to the GPU model it was tuned on (and by default refuses others), so
the manifest records the GPU's name and compute capability. PyTorch (a dependency anyway, and the
runtime's device-memory allocator) reports them; no extra CUDA Python package is needed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import NoCudaDeviceError


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # e.g. "Orin", "NVIDIA H100 80GB HBM3"
    compute_capability: str  # "major.minor", e.g. "8.7" for Jetson Orin

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        return cls(str(d["name"]), str(d["compute_capability"]))

    def describe(self) -> str:
        return f"{self.name} (compute capability {self.compute_capability})"


def current_device() -> DeviceInfo:
    """The current CUDA device, through PyTorch; NoCudaDeviceError when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise NoCudaDeviceError(
            f"PyTorch {torch.__version__} sees no CUDA GPU: TensorRT engines are built and run on "
            f"the GPU, and this toolkit uses PyTorch's CUDA build for device memory. On a Jetson "
            f"install NVIDIA's PyTorch wheel for your JetPack; elsewhere a CUDA build of torch; or "
            f"use backend='onnxruntime'")
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceInfo(torch.cuda.get_device_name(index), f"{major}.{minor}")
