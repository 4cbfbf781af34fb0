"""ONNX Runtime's C API through ctypes: what the Python binding does not expose.

The onnxruntime wheel ships its C library (``onnxruntime/capi/libonnxruntime.so.*``) beside the
Python extension, which links its own copy. Two things of the C API matter here and have no
Python binding:

- a ``PrepackedWeightsContainer``: sessions created with one share the packed copies (MLAS's
  layout of MatMulNBits and MatMul weights) of every initializer added to them by name
  (``AddInitializer``), so a graph that chains several layers can sit beside the layers' own
  graphs without a second copy of their packed weights;
- ``RunWithBinding`` on sessions of that library, a run without the Python binding's own work.

Only what those need is bound: an environment with one global thread pool, session options,
sessions from model bytes, tensors over numpy memory, IOBindings and runs. The function table's
order is ONNX Runtime's ABI (``OrtApi`` only ever grows at its end), so the indices below hold for
every release since API version ``API_VERSION``; the version asked for is that one.

The library is a second ONNX Runtime in the process with a thread pool of its own: run a step's
graphs all here or all in the Python binding, not both (two pools of spinning workers on the same
cores take turns).
"""

from __future__ import annotations

import ctypes as C
import glob
import sys
import warnings
from pathlib import Path

import numpy as np

from ..errors import SkipDecodeError

API_VERSION = 17  # the oldest OrtApi with every function below (ONNX Runtime 1.16)

# OrtApi's function pointers by index (onnxruntime_c_api.h, struct OrtApi, in declaration order)
_GET_ERROR_MESSAGE = 2
_RUN = 9
_CREATE_SESSION_OPTIONS = 10
_SET_LOG_SEVERITY = 22
_CREATE_RUN_OPTIONS = 39
_CREATE_TENSOR_WITH_DATA = 49
_CREATE_CPU_MEMORY_INFO = 69
_RELEASE_STATUS = 93
_RELEASE_MEMORY_INFO = 94
_RELEASE_SESSION = 95
_RELEASE_VALUE = 96
_RELEASE_RUN_OPTIONS = 97
_RELEASE_SESSION_OPTIONS = 100
_CREATE_ENV_WITH_GLOBAL_THREAD_POOLS = 119
_DISABLE_PER_SESSION_THREADS = 120
_CREATE_THREADING_OPTIONS = 121
_RELEASE_THREADING_OPTIONS = 122
_ADD_SESSION_CONFIG_ENTRY = 130
_RUN_WITH_BINDING = 133
_CREATE_IO_BINDING = 134
_RELEASE_IO_BINDING = 135
_BIND_INPUT = 136
_BIND_OUTPUT = 137
_CREATE_AND_REGISTER_ALLOCATOR = 144
_SET_GLOBAL_INTRA_OP_NUM_THREADS = 147
_SET_GLOBAL_SPIN_CONTROL = 149
_ADD_INITIALIZER = 150
_CREATE_PREPACKED_WEIGHTS_CONTAINER = 166
_CREATE_SESSION_FROM_ARRAY_WITH_CONTAINER = 169

# ONNXTensorElementDataType
_ELEMENT_TYPES = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3,
                  np.dtype(np.int32): 6, np.dtype(np.int64): 7, np.dtype(np.bool_): 9,
                  np.dtype(np.float16): 10}
_WARNING, _ERROR = 2, 3  # OrtLoggingLevel

_P = C.c_void_p
_PP = C.POINTER(C.c_void_p)


class CApiUnavailableError(SkipDecodeError, RuntimeError):
    """This ONNX Runtime installation has no C library this module can load."""


class CApiError(SkipDecodeError, RuntimeError):
    """A call into ONNX Runtime's C API failed; the message is ONNX Runtime's."""


def library_path() -> Path:
    """The C library the installed onnxruntime package ships beside its Python extension."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise CApiUnavailableError("ONNX Runtime's C API needs the onnxruntime package: "
                                   "pip install 'skipdecode-edge[cpu]'") from exc
    capi = Path(onnxruntime.__file__).parent / "capi"
    pattern = "onnxruntime.dll" if sys.platform == "win32" else (
        "libonnxruntime*.dylib" if sys.platform == "darwin" else "libonnxruntime.so*")
    found = sorted(glob.glob(str(capi / pattern)))
    if not found:
        raise CApiUnavailableError(
            f"no {pattern} in {capi}: this onnxruntime package ships no C library; "
            f"use the Python binding's sessions instead")
    return Path(found[-1])


class _Base(C.Structure):
    _fields_ = [("GetApi", C.CFUNCTYPE(_P, C.c_uint32)), ("GetVersionString", C.CFUNCTYPE(C.c_char_p))]


class Api:
    """The C API's functions this module uses, typed; one per process (``api()``)."""

    def __init__(self, path: Path | None = None):
        path = path or library_path()
        try:
            self._lib = C.CDLL(str(path))
        except OSError as exc:
            raise CApiUnavailableError(f"cannot load {path}: {exc}") from exc
        self._lib.OrtGetApiBase.restype = C.POINTER(_Base)
        base = self._lib.OrtGetApiBase().contents
        self.version = base.GetVersionString().decode()
        table = base.GetApi(API_VERSION)
        if not table:
            raise CApiUnavailableError(f"ONNX Runtime {self.version} has no C API version {API_VERSION}: "
                                       f"upgrade onnxruntime")
        self._table = C.cast(table, _PP)
        f = self._function
        self._message = f(_GET_ERROR_MESSAGE, C.c_char_p, _P)
        self._release_status = f(_RELEASE_STATUS, None, _P)
        self.create_threading_options = f(_CREATE_THREADING_OPTIONS, _P, _PP)
        self.release_threading_options = f(_RELEASE_THREADING_OPTIONS, None, _P)
        self.set_global_threads = f(_SET_GLOBAL_INTRA_OP_NUM_THREADS, _P, _P, C.c_int)
        self.set_global_spin = f(_SET_GLOBAL_SPIN_CONTROL, _P, _P, C.c_int)
        self.create_env = f(_CREATE_ENV_WITH_GLOBAL_THREAD_POOLS, _P, C.c_int, C.c_char_p, _P, _PP)
        self.register_allocator = f(_CREATE_AND_REGISTER_ALLOCATOR, _P, _P, _P, _P)
        self.create_session_options = f(_CREATE_SESSION_OPTIONS, _P, _PP)
        self.release_session_options = f(_RELEASE_SESSION_OPTIONS, None, _P)
        self.disable_per_session_threads = f(_DISABLE_PER_SESSION_THREADS, _P, _P)
        self.set_log_severity = f(_SET_LOG_SEVERITY, _P, _P, C.c_int)
        self.add_config_entry = f(_ADD_SESSION_CONFIG_ENTRY, _P, _P, C.c_char_p, C.c_char_p)
        self.add_initializer = f(_ADD_INITIALIZER, _P, _P, C.c_char_p, _P)
        self.create_container = f(_CREATE_PREPACKED_WEIGHTS_CONTAINER, _P, _PP)
        self.create_session = f(_CREATE_SESSION_FROM_ARRAY_WITH_CONTAINER, _P, _P, C.c_void_p, C.c_size_t,
                                _P, _P, _PP)
        self.release_session = f(_RELEASE_SESSION, None, _P)
        self.create_cpu_memory_info = f(_CREATE_CPU_MEMORY_INFO, _P, C.c_int, C.c_int, _PP)
        self.release_memory_info = f(_RELEASE_MEMORY_INFO, None, _P)
        self.create_tensor = f(_CREATE_TENSOR_WITH_DATA, _P, _P, C.c_void_p, C.c_size_t,
                               C.POINTER(C.c_int64), C.c_size_t, C.c_int, _PP)
        self.release_value = f(_RELEASE_VALUE, None, _P)
        self.create_run_options = f(_CREATE_RUN_OPTIONS, _P, _PP)
        self.release_run_options = f(_RELEASE_RUN_OPTIONS, None, _P)
        self.create_io_binding = f(_CREATE_IO_BINDING, _P, _P, _PP)
        self.release_io_binding = f(_RELEASE_IO_BINDING, None, _P)
        self.bind_input = f(_BIND_INPUT, _P, _P, C.c_char_p, _P)
        self.bind_output = f(_BIND_OUTPUT, _P, _P, C.c_char_p, _P)
        self.run_with_binding = f(_RUN_WITH_BINDING, _P, _P, _P, _P)
        self.run = f(_RUN, _P, _P, _P, C.POINTER(C.c_char_p), C.POINTER(_P), C.c_size_t,
                     C.POINTER(C.c_char_p), C.c_size_t, C.POINTER(_P))
        memory = _P()
        self.check(self.create_cpu_memory_info(0, 0, C.byref(memory)))  # OrtDeviceAllocator, OrtMemTypeDefault
        self.cpu = memory

    def _function(self, index: int, restype, *argtypes):
        return C.CFUNCTYPE(restype, *argtypes)(self._table[index])

    def check(self, status) -> None:
        """Raise ONNX Runtime's message where a call returned a status (None: success)."""
        if status:
            message = self._message(status).decode(errors="replace")
            self._release_status(status)
            raise CApiError(message)


_API: Api | None = None


def api() -> Api:
    """The process's one binding of the C library (loaded at first use)."""
    global _API
    if _API is None:
        _API = Api()
    return _API


class Value:
    """An OrtValue over a numpy array's memory (no copy): ONNX Runtime reads and writes the array."""

    def __init__(self, array: np.ndarray):
        a = api()
        if not array.flags.c_contiguous:
            raise ValueError("a Value needs a C-contiguous array (np.ascontiguousarray)")
        if array.dtype not in _ELEMENT_TYPES:
            raise ValueError(f"no ONNX element type for {array.dtype}")
        self.array = array  # kept alive as long as ONNX Runtime may read it
        shape = (C.c_int64 * max(array.ndim, 1))(*array.shape)
        self._handle = _P()
        a.check(a.create_tensor(a.cpu, array.ctypes.data, array.nbytes, shape, array.ndim,
                                _ELEMENT_TYPES[array.dtype], C.byref(self._handle)))

    @property
    def handle(self):
        return self._handle

    def __del__(self):
        if getattr(self, "_handle", None) and _API is not None:
            _API.release_value(self._handle)


class Environment:
    """The C library's environment: one intra-op pool of ``threads`` workers for all its sessions,
    spinning between operators or not, and one container of shared prepacked weights. The library
    keeps one environment per process: ``environment()`` makes it once."""

    def __init__(self, threads: int | None, spin: bool):
        a = api()
        self.threads, self.spin = threads, spin
        options = _P()
        a.check(a.create_threading_options(C.byref(options)))
        try:
            a.check(a.set_global_threads(options, int(threads or 0)))  # 0: one per physical core
            a.check(a.set_global_spin(options, 1 if spin else 0))
            self._env = _P()
            a.check(a.create_env(_ERROR, b"skipdecode", options, C.byref(self._env)))
        finally:
            a.release_threading_options(options)
        # one CPU arena for every session, not one each: each arena keeps its own high-water mark
        # (the Python binding's sessions share one too: backends/onnxruntime.py)
        arena = _P()
        a.check(a.create_cpu_memory_info(1, 0, C.byref(arena)))  # OrtArenaAllocator, OrtMemTypeDefault
        try:
            a.check(a.register_allocator(self._env, arena, None))  # None: the default arena settings
        finally:
            a.release_memory_info(arena)
        self._container = _P()
        a.check(a.create_container(C.byref(self._container)))
        self._run_options = _P()
        a.check(a.create_run_options(C.byref(self._run_options)))

    def session(self, model: bytes, initializers: dict[str, Value] | None = None,
                config: dict[str, str] | None = None) -> "Session":
        """A session of ``model`` (serialized ONNX), its initializers of those names taken from
        ``initializers`` (shared: their packed copies are made once for every session of this
        environment that adds the same values)."""
        return Session(self, model, initializers or {}, config or {})


_ENV: Environment | None = None


def environment(threads: int | None, spin: bool) -> Environment:
    """The process's environment, made by the first call; a later call with other settings gets
    it as it is (the library allows one), with a warning."""
    global _ENV
    if _ENV is None:
        _ENV = Environment(threads, spin)
    elif (_ENV.threads, _ENV.spin) != (threads, spin):
        warnings.warn(f"threads={threads}, spin={spin}: this process's ONNX Runtime C library runs every "
                      f"session on the pool of threads={_ENV.threads}, spin={_ENV.spin} that its first "
                      f"load made (the library allows one per process); load in a process of its own "
                      f"for other settings", stacklevel=3)
    return _ENV


class Session:
    def __init__(self, env: Environment, model: bytes, initializers: dict[str, Value],
                 config: dict[str, str]):
        a = api()
        self._env = env  # outlives its sessions
        self._values = dict(initializers)  # ONNX Runtime reads them for the session's lifetime
        options = _P()
        a.check(a.create_session_options(C.byref(options)))
        try:
            a.check(a.disable_per_session_threads(options))  # the environment's pool
            a.check(a.add_config_entry(options, b"session.use_env_allocators", b"1"))  # and its arena
            a.check(a.set_log_severity(options, _ERROR))
            for key, value in config.items():
                a.check(a.add_config_entry(options, key.encode(), value.encode()))
            for name, value in self._values.items():
                a.check(a.add_initializer(options, name.encode(), value.handle))
            self._handle = _P()
            a.check(a.create_session(env._env, model, len(model), options, env._container,
                                     C.byref(self._handle)))
        finally:
            a.release_session_options(options)

    def binding(self) -> "Binding":
        return Binding(self)

    def run_with_binding(self, binding: "Binding") -> None:
        a = _API
        a.check(a.run_with_binding(self._handle, self._env._run_options, binding._handle))

    def run(self, inputs: dict[str, Value], outputs: dict[str, Value]) -> None:
        """One run writing into the given outputs' arrays."""
        a = _API
        n_in, n_out = len(inputs), len(outputs)
        in_names = (C.c_char_p * n_in)(*[k.encode() for k in inputs])
        in_values = (_P * n_in)(*[v.handle for v in inputs.values()])
        out_names = (C.c_char_p * n_out)(*[k.encode() for k in outputs])
        out_values = (_P * n_out)(*[v.handle for v in outputs.values()])
        a.check(a.run(self._handle, self._env._run_options, in_names, in_values, n_in,
                      out_names, n_out, out_values))

    def __del__(self):
        if getattr(self, "_handle", None) and _API is not None:
            _API.release_session(self._handle)


class Binding:
    """An IOBinding: inputs and outputs bound once to Values, a run reads and writes their arrays."""

    def __init__(self, session: Session):
        a = api()
        self._session = session
        self._values: dict[tuple[str, str], Value] = {}  # kept alive while bound
        self._handle = _P()
        a.check(a.create_io_binding(session._handle, C.byref(self._handle)))

    def bind_input(self, name: str, value: Value) -> None:
        _API.check(_API.bind_input(self._handle, name.encode(), value.handle))
        self._values["in", name] = value

    def bind_output(self, name: str, value: Value) -> None:
        _API.check(_API.bind_output(self._handle, name.encode(), value.handle))
        self._values["out", name] = value

    def __del__(self):
        if getattr(self, "_handle", None) and _API is not None:
            _API.release_io_binding(self._handle)


def available() -> bool:
    """Whether this process can load the C library (no error raised)."""
    try:
        api()
    except CApiUnavailableError:
        return False
    return True


__all__ = ["API_VERSION", "Api", "Binding", "CApiError", "CApiUnavailableError", "Environment",
           "Session", "Value", "api", "available", "environment", "library_path"]
