"""Stand-ins for TensorRT, shared by the engine and backend tests (TensorRT cannot be installed here).

FakeToolchain replaces the builder: its "plan" is JSON naming the source ONNX, the graph spec and
the profiles. FakeTensorRT replaces the runtime: it deserializes those plans into engines that run
the ONNX with ONNX Runtime on *host* pointers, so the backend's real buffer, profile and KV logic
runs end to end on torch CPU tensors. It checks what TensorRT would refuse (shapes outside the
active profile, unset addresses, outputs overlapping inputs) and records profile switches and the
address and shape bound to every input of every execution (to check the past is bound in place).
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np

from engines.device import DeviceInfo
from engines.profiles import Profile
from runtime.artifact.manifest import GraphSpec

ORIN = DeviceInfo("Orin", "8.7")
NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64}


class SimulatedCrash(RuntimeError):
    """Raised by FakeToolchain(fail_on=...) in the middle of a build."""


class FakeToolchain:
    def __init__(self, version: str = "10.3.0", device: DeviceInfo = ORIN, fail_on: str | None = None):
        self.version, self.device, self.fail_on = version, device, fail_on
        self.compiled: list[str] = []  # graphs compiled, in order, over every build
        self.caches_seen: list = []  # the timing cache bytes each build started from
        self.plans = []  # the NetworkPlan of each build

    def compiler(self, plan, config, timing_cache, log=print):
        self.caches_seen.append(timing_cache)
        self.plans.append(plan)
        return FakeCompiler(self, timing_cache)


class FakeCompiler:
    def __init__(self, toolchain: FakeToolchain, timing_cache):
        self.toolchain = toolchain
        self.entries = timing_cache.decode().split(",") if timing_cache else []

    def compile(self, spec: GraphSpec, onnx_path, profiles: list[Profile]) -> bytes:
        if spec.name == self.toolchain.fail_on:
            raise SimulatedCrash(f"simulated crash while building {spec.name}")
        self.toolchain.compiled.append(spec.name)
        self.entries.append(spec.name)
        return json.dumps({"fake_plan": 1, "tensorrt": self.toolchain.version, "onnx": str(onnx_path),
                           "spec": asdict(spec), "profiles": [p.to_dict() for p in profiles]}).encode()

    def timing_cache(self) -> bytes:
        return ",".join(self.entries).encode()


# -- runtime side ---------------------------------------------------------------------------

class _Logger:
    WARNING = "WARNING"

    def __init__(self, severity):
        self.severity = severity


class FakeTensorRT:
    """The slice of the ``tensorrt`` module the backend uses, in the flavour of ``version``."""

    def __init__(self, version: str = "10.3.0", int_dtype: str = "INT64", rename: dict | None = None):
        self.__version__ = version
        self.int_dtype = int_dtype  # TensorRT 8.x imports int64 ONNX inputs as INT32 bindings
        self.rename = rename or {}  # tensor name -> name the fake engine reports instead
        self.Logger = _Logger
        self.TensorIOMode = SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
        self.ExecutionContextAllocationStrategy = SimpleNamespace(USER_MANAGED="USER_MANAGED")
        self.switches: list[tuple[str, int]] = []  # (graph, profile) per set_optimization_profile_async
        self.executions: list[tuple[str, int]] = []  # (graph, active profile) per execute_async_v3
        self.context_apis: set[str] = set()  # how contexts were created
        self.scratch: list = []  # (ptr, size) given to each context
        self.bound: list = []  # (graph, profile, {input: (address, shape)}) per execute_async_v3

    def Runtime(self, logger):
        return SimpleNamespace(deserialize_cuda_engine=lambda data: FakeEngine(self, bytes(data)))


class FakeEngine:
    def __init__(self, trt: FakeTensorRT, data: bytes):
        plan = json.loads(data)
        assert plan["tensorrt"] == trt.__version__, "a plan loads only in the version that built it"
        self.trt, self.onnx = trt, plan["onnx"]
        self.spec = GraphSpec.from_dict(plan["spec"])
        self.profiles = [Profile.from_dict(p) for p in plan["profiles"]]
        self.tensors = {t.name: (trt.TensorIOMode.OUTPUT, t) for t in self.spec.outputs}
        self.tensors.update({t.name: (trt.TensorIOMode.INPUT, t) for t in self.spec.inputs})
        self.names = [trt.rename.get(n, n) for n in self.tensors]  # outputs first: order is not a contract
        self.device_memory_size = 4096
        self._session = None

    def _real(self, name):
        return next((k for k, v in self.trt.rename.items() if v == name), name)

    @property
    def num_io_tensors(self):
        return len(self.names)

    @property
    def num_optimization_profiles(self):
        return len(self.profiles)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_mode(self, name):
        return self.tensors[self._real(name)][0]

    def get_tensor_dtype(self, name):
        dtype = self.tensors[self._real(name)][1].dtype
        names = {"float32": "FLOAT", "float16": "HALF", "int64": self.trt.int_dtype}
        return SimpleNamespace(name=names[dtype])

    def get_tensor_profile_shape(self, name, index):
        r = self.profiles[index].shapes[name]
        return r.min, r.opt, r.max

    @property
    def _v10(self):
        return int(self.trt.__version__.split(".")[0]) >= 10

    def create_execution_context(self, strategy=None):
        assert self._v10, "8.x takes no allocation strategy"
        assert strategy == "USER_MANAGED", "the backend supplies the activation memory"
        self.trt.context_apis.add("strategy")
        return FakeContext10(self)

    def create_execution_context_without_device_memory(self):
        self.trt.context_apis.add("without_device_memory")
        return FakeContext10(self) if self._v10 else FakeContext(self)

    @property
    def session(self):
        if self._session is None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            self._session = ort.InferenceSession(self.onnx, opts, providers=["CPUExecutionProvider"])
        return self._session


def _array_at(ptr: int, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).reshape(shape)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.active = None
        self.shapes, self.addresses = {}, {}

    @property
    def device_memory(self):
        raise AttributeError("write-only, as in TensorRT")

    @device_memory.setter
    def device_memory(self, ptr):  # TensorRT 8.x
        self.engine.trt.scratch.append((ptr, None))

    def set_optimization_profile_async(self, index, stream):
        self.engine.trt.switches.append((self.engine.spec.name, index))
        self.active, self.shapes = index, {}
        return True

    def set_input_shape(self, name, shape):
        assert self.active is not None, "set a profile before shapes"
        if not self.engine.profiles[self.active].shapes[self.engine._real(name)].contains(shape):
            return False  # TensorRT refuses a shape outside the active profile
        self.shapes[self.engine._real(name)] = tuple(shape)
        return True

    def _sizes(self):
        sizes = {}
        for t in self.engine.spec.inputs:
            for dim, n in zip(t.dims, self.shapes[t.name]):
                if isinstance(dim, str):
                    sizes[dim] = n
        return sizes

    def get_tensor_shape(self, name):
        sizes = self._sizes()
        tensor = self.engine.tensors[self.engine._real(name)][1]
        return tuple(sizes.get(d, d) for d in tensor.dims)

    def set_tensor_address(self, name, ptr):
        self.addresses[self.engine._real(name)] = ptr
        return True

    def execute_async_v3(self, stream):
        engine = self.engine
        feeds, spans = {}, []
        for t in engine.spec.inputs:
            assert t.name in self.shapes and t.name in self.addresses, f"{t.name} not set"
            dtype = NUMPY[engine.get_tensor_dtype(t.name).name]
            array = _array_at(self.addresses[t.name], self.shapes[t.name], dtype)
            spans.append((self.addresses[t.name], array.nbytes))
            feeds[t.name] = array.astype(np.int64) if t.dtype == "int64" else array.copy()
        outputs = engine.session.run(None, feeds)
        for t, value in zip(engine.spec.outputs, outputs):
            ptr = self.addresses[t.name]
            for start, size in spans:  # TensorRT reads inputs while writing outputs: no aliasing
                assert size == 0 or value.nbytes == 0 or ptr + value.nbytes <= start or start + size <= ptr, \
                    f"{engine.spec.name}: output {t.name} overlaps an input"
            assert tuple(value.shape) == self.get_tensor_shape(t.name)
            np.copyto(_array_at(ptr, value.shape, NUMPY[engine.get_tensor_dtype(t.name).name]), value)
        engine.trt.executions.append((engine.spec.name, self.active))
        engine.trt.bound.append((engine.spec.name, self.active,
                                 {t.name: (self.addresses[t.name], self.shapes[t.name]) for t in engine.spec.inputs}))
        return True


class FakeContext10(FakeContext):
    def set_device_memory(self, ptr, size):  # TensorRT 10.1+ (setDeviceMemoryV2)
        assert size >= self.engine.device_memory_size
        self.engine.trt.scratch.append((ptr, size))


# -- Polygraphy side ------------------------------------------------------------------------------


def fake_trt_runner(trt: FakeTensorRT):
    """An ``engines.verify`` runner factory: Polygraphy's TrtRunner needs CUDA, so this BaseRunner
    does what it does with a plan on the fake: deserialize it, report the engine's bindings (INT32
    ids on a TensorRT 8.x flavour) with the selected profile's ranges, refuse shapes outside that
    profile, and run the engine (the graph in ONNX Runtime)."""
    import time
    from collections import OrderedDict
    from pathlib import Path

    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata

    class FakeTrtRunner(BaseRunner):
        def __init__(self, plan, profile: int, name: str):
            super().__init__(name=name, prefix="fake-trt-runner")
            self.engine = trt.Runtime(None).deserialize_cuda_engine(Path(plan).read_bytes())
            self.profile = self.engine.profiles[profile]
            self.shapes = []  # the input shapes of every inference

        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def dtype(self, name):
            return np.dtype(NUMPY[self.engine.get_tensor_dtype(name).name])

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for t in self.engine.spec.inputs:
                r = self.profile.shapes[t.name]
                shape = [lo if lo == hi else -1 for lo, hi in zip(r.min, r.max)]
                meta.add(t.name, dtype=self.dtype(t.name), shape=shape, min_shape=r.min, max_shape=r.max)
            return meta

        def infer_impl(self, feed_dict):
            for name, array in feed_dict.items():
                assert self.profile.shapes[name].contains(array.shape), f"{name} {array.shape} outside the profile"
                assert array.dtype == self.dtype(name), f"{name}: {array.dtype} bound to {self.dtype(name)}"
            self.shapes.append({n: a.shape for n, a in feed_dict.items()})
            feeds = {n: a.astype(np.int64) if a.dtype.kind == "i" else a for n, a in feed_dict.items()}
            started = time.perf_counter()
            outputs = self.engine.session.run(None, feeds)
            self.inference_time = time.perf_counter() - started  # Comparator.run sums these
            return OrderedDict(zip((o.name for o in self.engine.spec.outputs), outputs))

    return FakeTrtRunner
