"""The GPU engines are built for and run on, as the engine manifest records it.

A TensorRT plan is specific to the GPU it was tuned on (and by default refuses others), so the
manifest records the GPU's name and compute capability, and where the driver tells them, the
module, its multiprocessors (SMs) and its memory. Name and compute capability alone cannot tell
Jetsons apart: every Orin module reports "Orin" and 8.7, from the AGX Orin 64GB (16 SMs) to the
Orin Nano 4GB (4 SMs), and a plan tuned on one is slow or fails on another (TensorRT's developer
guide: an engine is specific to the device it was built on). PyTorch (a dependency anyway, and the
runtime's device-memory allocator) reports them; a Jetson names its module in the device tree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import NoCudaDeviceError

DEVICE_TREE_MODEL = Path("/proc/device-tree/model")  # a Jetson's module, e.g. "NVIDIA Jetson Orin Nano Developer Kit"
MEMORY_SLACK = 1.25  # memory totals this close are one module's (JetPack releases move the carve-outs)


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # e.g. "Orin", "NVIDIA H100 80GB HBM3"
    compute_capability: str  # "major.minor", e.g. "8.7" for Jetson Orin
    module: str | None = None  # the board's model where its device tree names one (Jetson), else None
    multiprocessors: int | None = None  # SMs (None: an engine manifest written before they were recorded)
    memory_mib: int | None = None  # the GPU's total memory (a Jetson's: the memory it shares with the CPU)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def describe(self) -> str:
        extra = [self.module or "", f"{self.multiprocessors} SMs" if self.multiprocessors else "",
                 f"{self.memory_mib / 1024:.1f} GiB" if self.memory_mib else ""]
        return f"{self.name} (compute capability {self.compute_capability}" + \
            "".join(f", {e}" for e in extra if e) + ")"

    def differs(self, other: "DeviceInfo") -> str | None:
        """What tells ``other`` apart from this device as a TensorRT plan sees it (None: the same
        GPU). A field one of them lacks (an older engine manifest, no device tree) is not compared."""
        if (self.name, self.compute_capability) != (other.name, other.compute_capability):
            return "another GPU model"
        if self.module and other.module and self.module != other.module:
            return "another module"
        if self.multiprocessors and other.multiprocessors and self.multiprocessors != other.multiprocessors:
            return f"{self.multiprocessors} SMs against {other.multiprocessors}"
        if self.memory_mib and other.memory_mib and \
                max(self.memory_mib, other.memory_mib) > MEMORY_SLACK * min(self.memory_mib, other.memory_mib):
            return "another memory size"
        return None


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
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(torch.cuda.get_device_name(index), f"{major}.{minor}", module=board_model(),
                      multiprocessors=int(props.multi_processor_count), memory_mib=int(props.total_memory) >> 20)


def board_model(path: Path = DEVICE_TREE_MODEL) -> str | None:
    """The board's model as its device tree names it (a Jetson's module and carrier), else None."""
    try:
        text = path.read_bytes().decode("utf-8", "replace").strip("\x00").strip()
    except OSError:
        return None
    return text or None
