"""The few functions that call TensorRT's builder: ONNX -> network -> serialized plan.

Everything that can be decided without TensorRT (profiles, flags per version, resume decisions,
manifests) lives in other modules and is unit-tested on CPU machines; this module is the thin
layer that turns those decisions into API calls. APIs used, and where they exist:

  trt.Builder, create_network(flags), create_builder_config, create_optimization_profile,
  build_serialized_network                                            8.x, 10.x
  trt.OnnxParser.parse_from_file (external weights next to the file), num_errors, get_error
  IOptimizationProfile.set_shape(name, min, opt, max)
  IBuilderConfig.set_memory_pool_limit(MemoryPoolType.WORKSPACE, n)  8.4+ (max_workspace_size is gone in 10)
  IBuilderConfig.set_flag(BuilderFlag.FP16 / OBEY_PRECISION_CONSTRAINTS)   weak typing, 8.x/10.x
  IBuilderConfig.create_timing_cache(bytes) / set_timing_cache(cache, ignore_mismatch)
  ITimingCache.serialize()                                           shared across builds (8.0+)
  ILayer.precision / set_output_type(i, dtype)                       weak typing only
"""

from __future__ import annotations

import time
from pathlib import Path

from .config import EngineBuildConfig
from .device import DeviceInfo, current_device
from .errors import EngineBuildError, TensorRTMissingError
from .profiles import Profile
from .versions import NetworkPlan, check_supported, keep_fp32

INSTALL_HINT = (
    "On a Jetson, TensorRT comes with JetPack (`sudo apt install nvidia-jetpack`, or just "
    "python3-libnvinfer) and is importable from the system Python 3, or from a venv created with "
    "--system-site-packages; on x86 with an NVIDIA GPU, `pip install tensorrt` or use an NVIDIA "
    "container (nvcr.io/nvidia/tensorrt or nvcr.io/nvidia/pytorch). Without TensorRT, run "
    "backend='onnxruntime' (or 'torch').")


def import_tensorrt():
    """``import tensorrt`` with an error that says how to get it; checks the minimum version."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTMissingError(
            f"TensorRT is not installed in this Python environment ({exc}). {INSTALL_HINT}") from exc
    check_supported(trt.__version__)
    return trt


def network_flags(trt, plan: NetworkPlan) -> int:
    flags = 0
    if plan.explicit_batch:  # 8.x; absent or ignored later, so only named when asked for
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if plan.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return flags


def pin_fp32_layers(trt, network) -> list[str]:
    """Weak typing with FP16: keep normalization and softmax layers (and their outputs) in fp32.

    Returns the names of the layers pinned; they bind only with OBEY_PRECISION_CONSTRAINTS.
    """
    pinned = []
    floats = (trt.float32, trt.float16)
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if not keep_fp32(layer.type.name, layer.name):
            continue
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            if layer.get_output(j).dtype in floats:  # never retype an index or bool output
                layer.set_output_type(j, trt.float32)
        pinned.append(layer.name)
    return pinned


class TensorRTToolchain:
    """The installed TensorRT on the current GPU: what engines/build.py builds with."""

    def __init__(self, trt=None, device: DeviceInfo | None = None):
        self.trt = trt or import_tensorrt()
        self.version = self.trt.__version__
        self.device = device or current_device()

    def compiler(self, plan: NetworkPlan, config: EngineBuildConfig, timing_cache: bytes | None,
                 log=print) -> "EngineCompiler":
        return EngineCompiler(self.trt, plan, config, timing_cache, log)


class EngineCompiler:
    """One builder and one timing cache for all graphs of a build (the decoder layers share shapes,
    so after the first layer most tactic timings come from the cache)."""

    def __init__(self, trt, plan: NetworkPlan, config: EngineBuildConfig, timing_cache: bytes | None,
                 log=print):
        self.trt, self.plan, self.config, self.log = trt, plan, config, log
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.builder = trt.Builder(self.logger)
        self.cache = self._open_cache(timing_cache)

    def _open_cache(self, data: bytes | None):
        seed = self.builder.create_builder_config()  # a timing cache is created through a config
        if data:
            try:
                cache = seed.create_timing_cache(data)
                if cache is not None and seed.set_timing_cache(cache, ignore_mismatch=False):
                    return cache
            except Exception as exc:  # a corrupt file must not stop a build, only slow it
                self.log(f"ignoring the timing cache ({exc})")
            else:
                self.log("ignoring the timing cache: TensorRT rejected it (other version or GPU)")
        return seed.create_timing_cache(b"")

    def compile(self, spec, onnx_path: Path, profiles: list[Profile]):
        """Serialized plan (IHostMemory, a buffer) of one graph; EngineBuildError on failure."""
        trt = self.trt
        network = self.builder.create_network(network_flags(trt, self.plan))
        parser = trt.OnnxParser(network, self.logger)
        ok = parser.parse_from_file(str(onnx_path))  # from the file: finds external .data beside it
        if not ok or parser.num_errors:
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "no detail"
            raise EngineBuildError(
                f"TensorRT {trt.__version__} could not parse {onnx_path}: {errors}. Check that the "
                f"graph's operators are supported by this TensorRT's ONNX parser (opset of the "
                f"export, see `python -m export verify`), or re-export with `python -m export build`")
        config = self.builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.config.workspace)
        if self.plan.fp16_flag:
            config.set_flag(trt.BuilderFlag.FP16)
        if self.plan.fp32_layers and pin_fp32_layers(trt, network):
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        for profile in profiles:  # added in index order: 0 = prefill, 1 = decode
            p = self.builder.create_optimization_profile()
            for name, r in profile.shapes.items():
                p.set_shape(name, r.min, r.opt, r.max)
            config.add_optimization_profile(p)
        config.set_timing_cache(self.cache, ignore_mismatch=False)
        started = time.perf_counter()
        plan = self.builder.build_serialized_network(network, config)
        if plan is None:
            raise EngineBuildError(
                f"TensorRT {trt.__version__} could not build the engine of {spec.name} (see its log "
                f"above). On 8 GB devices the usual cause is memory: close other GPU programs, lower "
                f"--workspace (e.g. 1GiB) or --max-batch / --max-seq, and rerun (finished engines are kept)")
        self.log(f"built {spec.name} in {time.perf_counter() - started:.1f}s")
        return plan

    def timing_cache(self) -> bytes:
        return bytes(memoryview(self.cache.serialize()))
