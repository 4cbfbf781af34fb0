"""TensorRT backend: one engine and one execution context per graph, everything in device memory.

Build the engines first, on the device: ``python -m engines build ARTIFACT_DIR`` (see engines/).
The runtime finds this backend through the ``skipdecode_edge.backends`` entry point (pyproject.toml),
so ``runtime`` imports nothing from ``engines``: the arrows point from engines to runtime only.

Device memory is PyTorch's CUDA allocator (torch is a dependency already, and Jetson images bring a
CUDA build): buffers are torch tensors whose ``data_ptr()`` goes to ``set_tensor_address``, and
all work runs on one private CUDA stream, so TensorRT launches and torch copies stay ordered
without host synchronisation. Only the input ids, the attention mask and a few small index arrays
go host -> device per step, and only the requested rows' last-position logits come back.

Buffers are preallocated: the KV cache by the runtime's KVCache (rows and capacity: the
Generator's max_batch and max_length, checked against the engines' max_batch and max_seq), the
rest from the engines' limits (engines.json):

- KV cache, in the layer graph contract's layout (export/onnx_export.py): per layer one K buffer
  (rows, nh, hd, W) and one V buffer (rows, nh, W, hd), torch tensors exactly W wide
  (runtime.kvcache.ArrayStorage), so the block of rows a step runs is contiguous and is bound as
  past_key/past_value in place (no copy). The graph returns only the new K/V, into two small
  scratch buffers, and torch indexing on the stream writes them to each updated row's own
  positions.
- hidden states: two buffers of max_batch x max_prompt x hidden, ping-ponged between layers. Rows
  a layer does not update (per-row SkipDecode budgets) get their input hidden state copied back.
- one scratch block for TensorRT's activations, shared by all contexts: they run one after the
  other on one stream, so the largest engine's need is enough (instead of one block per context,
  which for 26 contexts at prefill shapes does not fit an 8 GB Jetson).

Profiles (engines/profiles.py): 0 = prefill (sequence 1..max_prompt), 1 = decode (sequence 1),
both over a past of whole pages up to max_seq. A layer call asks for its phase's profile (a
decode step fits both); the embedding and the head stay on the current profile while it holds
their shapes. A switch goes through ``set_optimization_profile_async`` and resets
the context's input shapes, so a request joining a running batch costs each layer two switches
(its prefill, then decode again). With the tensor-name API (TensorRT 8.5.1+, the only API in
10.x) names are the same in every profile; the old per-profile binding indices are not used.

CUDA graph capture per active-layer set is not implemented: ``cuda_graphs=True`` raises.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import numpy as np

from runtime.artifact.manifest import GraphSpec, Manifest
from runtime.backends.base import (Backend, DecodeStep, VerifyPass, decode_hidden, run_decode, run_verify,
                                   verify_hidden)
from runtime.errors import ArtifactError, SkipDecodeError
from runtime.kvcache import ArrayStorage, KVCache, pages_width

from .errors import EngineLimitError, EngineMismatchError, EngineRuntimeError, rebuild_hint
from .manifest import DEFAULT_ENGINE_DIR, read_engine_manifest, validate
from .profiles import DECODE, PREFILL, Profile, ShapeRange, choose_profile
from .versions import parse_version


class CudaGraphsNotImplementedError(SkipDecodeError, NotImplementedError):
    """cuda_graphs=True on the TensorRT backend, which does not capture CUDA graphs yet."""


# -- seams: the GPU-free tests replace these with a fake tensorrt, a fake GPU and host memory --

def _import_tensorrt():
    from .builder import import_tensorrt

    return import_tensorrt()


def _current_device():
    from .device import current_device

    return current_device()


def _open_device():
    return CudaDevice()


class CudaDevice:
    """torch's current CUDA device and a private stream (TensorRT warns against the default one)."""

    def __init__(self):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device)

    @property
    def handle(self) -> int:
        return int(self.stream.cuda_stream)

    def scope(self):
        return self.torch.cuda.stream(self.stream)  # torch copies go on the same stream as TensorRT


class HostDevice:
    """Host memory and no stream: for the GPU-free tests, whose fake TensorRT reads host pointers."""

    def __init__(self):
        import torch

        self.torch = torch
        self.device = torch.device("cpu")
        self.handle = 0

    def scope(self):
        return contextlib.nullcontext()


# -- pure helpers, tested without TensorRT -----------------------------------------------------

_TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32",
                 "INT64": "int64", "INT8": "int8", "UINT8": "uint8", "BOOL": "bool"}


def torch_dtype(torch, trt_dtype_name: str):
    """trt.DataType member name ("HALF", "INT32", ...) -> torch dtype."""
    try:
        return getattr(torch, _TORCH_DTYPES[trt_dtype_name])
    except KeyError:
        raise ArtifactError(f"TensorRT data type {trt_dtype_name} has no torch equivalent here") from None


def check_engine_io(spec: GraphSpec, io: dict, plan: Path, artifact_dir) -> None:
    """io: {name: ("input" | "output", dtype name)} read from the engine. ArtifactError on mismatch."""
    inputs = sorted(n for n, (mode, _) in io.items() if mode == "input")
    outputs = sorted(n for n, (mode, _) in io.items() if mode == "output")
    expected = ([t.name for t in spec.inputs], [t.name for t in spec.outputs])
    if inputs != sorted(expected[0]) or outputs != sorted(expected[1]):
        raise ArtifactError(
            f"{plan} has inputs {inputs} and outputs {outputs}, but the artifact manifest says "
            f"{expected[0]} and {expected[1]} for {spec.name}: engines and artifact come from "
            f"different exports; {rebuild_hint(artifact_dir)}")


def context_memory_api(version: str) -> str:
    """How to create a context whose activation memory we supply (shared across contexts).

    10.x: create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED);
    8.x: create_execution_context_without_device_memory() (deprecated in 10.0).
    """
    return "strategy" if parse_version(version)[0] >= 10 else "without_device_memory"


def _volume(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


# -- one engine, one context ----------------------------------------------------------------

class GraphRunner:
    """Runs one engine: picks its profile, sets shapes and addresses, enqueues on the stream."""

    def __init__(self, trt, engine, spec: GraphSpec, plan: Path, artifact_dir):
        self.trt, self.engine, self.spec = trt, engine, spec
        self.io = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = "input" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "output"
            self.io[name] = (mode, engine.get_tensor_dtype(name).name)
        check_engine_io(spec, self.io, plan, artifact_dir)
        self.inputs = [t.name for t in spec.inputs]
        self.profiles = [
            Profile(f"profile {k}", {n: ShapeRange(*(tuple(int(d) for d in s)
                                                     for s in engine.get_tensor_profile_shape(n, k)))
                                     for n in self.inputs})
            for k in range(engine.num_optimization_profiles)]
        if context_memory_api(trt.__version__) == "strategy":
            self.context = engine.create_execution_context(
                trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        else:
            self.context = engine.create_execution_context_without_device_memory()
        if self.context is None:
            raise EngineRuntimeError(f"TensorRT could not create an execution context for {plan}")
        self.active: int | None = None  # set explicitly on first use rather than trusting a default
        self.shapes: dict[str, tuple] = {}

    @property
    def scratch_bytes(self) -> int:
        size = getattr(self.engine, "device_memory_size_v2", None)  # 10.1+; the old one is deprecated
        return int(self.engine.device_memory_size if size is None else size)

    def set_scratch(self, ptr: int, size: int) -> None:
        if hasattr(self.context, "set_device_memory"):  # 10.1+ (setDeviceMemoryV2)
            self.context.set_device_memory(ptr, size)
        else:
            self.context.device_memory = ptr

    def dtype(self, name: str) -> str:
        return self.io[name][1]

    def run(self, inputs: dict, outputs: dict, stream: int, prefer: int | None = None) -> None:
        """inputs/outputs: {name: contiguous torch tensor of the exact logical shape}.
        prefer: the profile of the caller's phase, taken when it holds the shapes."""
        ctx = self.context
        shapes = {n: tuple(t.shape) for n, t in inputs.items()}
        index = choose_profile(self.profiles, shapes, self.active, graph=self.spec.name, prefer=prefer)
        if index != self.active:
            if not ctx.set_optimization_profile_async(index, stream):
                raise EngineRuntimeError(f"{self.spec.name}: TensorRT refused optimization profile {index}")
            self.active, self.shapes = index, {}  # a switch invalidates the input shapes
        for name, tensor in inputs.items():
            if self.shapes.get(name) != shapes[name]:
                if not ctx.set_input_shape(name, shapes[name]):
                    raise EngineRuntimeError(
                        f"{self.spec.name}: TensorRT refused shape {shapes[name]} for {name} in profile {index}")
                self.shapes[name] = shapes[name]
            ctx.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in outputs.items():
            produced = tuple(ctx.get_tensor_shape(name))
            if produced != tuple(tensor.shape):  # a wrong buffer size would be a memory overrun
                raise ArtifactError(
                    f"{self.spec.name}: the engine makes {name} of shape {produced} from {shapes}, "
                    f"the graph contract says {tuple(tensor.shape)}; the engine is not from this "
                    f"artifact's export")
            ctx.set_tensor_address(name, tensor.data_ptr())
        if not ctx.execute_async_v3(stream):
            raise EngineRuntimeError(f"{self.spec.name}: TensorRT execute_async_v3 failed (see its log)")


# -- the backend --------------------------------------------------------------------------------

class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, directory, manifest: Manifest, engine_dir=None, cuda_graphs: bool = False):
        if cuda_graphs:
            raise CudaGraphsNotImplementedError(
                "cuda_graphs=True is not implemented for the TensorRT backend yet (CUDA graph capture "
                "per active-layer set); run without it")
        trt = _import_tensorrt()
        self.directory = Path(directory)
        self.engine_dir = Path(engine_dir) if engine_dir is not None else self.directory / DEFAULT_ENGINE_DIR
        em = read_engine_manifest(self.engine_dir, self.directory)
        validate(em, manifest, trt.__version__, _current_device(), self.engine_dir, self.directory)
        self.manifest, self.engine_manifest = manifest, em
        self.max_batch = int(em.settings["max_batch"])
        self.max_seq = int(em.settings["max_seq"])
        self.max_prompt = int(em.settings["max_prompt"])
        self._device = _open_device()
        torch = self._device.torch

        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._runners: dict[str, GraphRunner] = {}
        self._engines = []
        for spec in manifest.graphs:
            self._runners[spec.name] = self._load(trt, spec, em.engines[spec.name])
        self._layer_names = [g.name for g in manifest.layers]

        # One dtype for hidden states and KV between graphs: the engines' own I/O types.
        first = manifest.layers[0]
        hidden_name, _, key_name, _ = (t.name for t in first.inputs)
        self._act_dtype = torch_dtype(torch, self._runners[first.name].dtype(hidden_name))
        kv_dtype = self._runners[first.name].dtype(key_name)
        for spec in manifest.graphs:
            for t in [*spec.inputs, *spec.outputs]:
                if t.dtype in ("float32", "float16") and self._runners[spec.name].dtype(t.name) != kv_dtype:
                    raise ArtifactError(
                        f"engine {spec.name} has {t.name} of type {self._runners[spec.name].dtype(t.name)}, "
                        f"but {first.name} exchanges {kv_dtype}: the engines do not belong together; "
                        f"{rebuild_hint(self.directory)}")
        m = manifest.model
        self._nh, self._hd, self._d, self._v = m.kv_heads, m.head_dim, m.hidden_size, m.vocab_size
        self._page = manifest.page_size
        dev, B = self._device.device, self.max_batch
        empty = lambda n, dtype: torch.empty(n, dtype=dtype, device=dev)  # noqa: E731

        self._hidden = [empty(B * self.max_prompt * self._d, self._act_dtype) for _ in range(2)]
        # The graph's new K/V land here, then go to the rows' positions: writing them straight
        # into the cache would need one graph output per row position (TensorRT binds one address).
        new = B * self._nh * self.max_prompt * self._hd  # (B, nh, T, hd) at the prefill limit
        self._new = (empty(new, self._act_dtype), empty(new, self._act_dtype))
        self._head_in = empty(B * self._d, self._act_dtype)
        head = manifest.head
        logits_dtype = torch_dtype(torch, self._runners["head"].dtype(head.outputs[0].name))
        self._logits = empty(B * self._v, logits_dtype)
        ids_name = manifest.embed.inputs[0].name
        self._ids = empty(B * self.max_prompt, torch_dtype(torch, self._runners["embed"].dtype(ids_name)))
        # Widest mask: a prefill chunk of max_prompt over the widest past (whole pages of max_seq).
        self._mask_width = pages_width(self.max_seq, self._page) + self.max_prompt
        self._mask_buffers: dict = {}  # torch dtype -> flat buffer of max_batch x _mask_width
        self._mask_source = None  # the host mask last uploaded; the engine builds a new one per step
        self._mask_views: dict = {}  # torch dtype -> (B, S) view of the upload

        scratch = max((r.scratch_bytes for r in self._runners.values()), default=0)
        self._scratch = empty(max(scratch, 1), torch.uint8)  # torch blocks are 512-byte aligned
        for runner in self._runners.values():
            runner.set_scratch(self._scratch.data_ptr(), scratch)
        self.storage: StreamStorage | None = None

    def _load(self, trt, spec: GraphSpec, entry) -> GraphRunner:
        path = self.engine_dir / entry.plan
        if not path.is_file():
            raise EngineMismatchError(f"{path} is missing; {rebuild_hint(self.directory)}")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.plan_sha256:
            raise EngineMismatchError(
                f"{path} does not match its sha256 in engines.json: the plan was modified or "
                f"corrupted; {rebuild_hint(self.directory)}")
        engine = self._runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise EngineMismatchError(
                f"TensorRT {trt.__version__} could not deserialize {path} (see its log); "
                f"{rebuild_hint(self.directory)}")
        self._engines.append(engine)
        return GraphRunner(trt, engine, spec, path, self.directory)

    # -- KV cache ----------------------------------------------------------------------------

    def limits(self) -> tuple[int, int]:
        return self.max_batch, self.max_seq  # what the engines' profiles were built for

    def max_tokens(self) -> int:
        return self.max_prompt  # the prefill profile and the hidden buffers end there

    def check_limits(self, rows: int, length: int) -> None:
        hint = f"rebuild the engines with `python -m engines build {self.directory}"
        if rows > self.max_batch:
            raise EngineLimitError(
                f"max_batch {rows} (KV rows) exceeds max_batch {self.max_batch} of the engines in "
                f"{self.engine_dir}; load with runtime.load(..., max_batch={self.max_batch}), or "
                f"{hint} --max-batch {rows}`")
        if length > self.max_seq:
            raise EngineLimitError(
                f"max_length {length} (prompt + new tokens per row) exceeds max_seq {self.max_seq} "
                f"of the engines in {self.engine_dir}; load with runtime.load(..., "
                f"max_length={self.max_seq}), or {hint} --max-seq {length}`")

    def kv_storage(self) -> "StreamStorage":
        self._mask_source, self._mask_views = None, {}
        self.storage = StreamStorage(self)
        return self.storage

    # -- uploads -----------------------------------------------------------------------------

    def _upload(self, array: np.ndarray):
        """A small int64 host array as a device tensor (ordered on the stream)."""
        torch = self._device.torch
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self._device.device)

    def _mask(self, attention_mask: np.ndarray, dtype_name: str):
        """(B, S) device copy of the host mask, uploaded once per step and dtype."""
        torch = self._device.torch
        dtype = torch_dtype(torch, dtype_name)
        if self._mask_source is not attention_mask:
            self._mask_source, self._mask_views = attention_mask, {}
        view = self._mask_views.get(dtype)
        if view is None:
            B, S = attention_mask.shape
            if S > self._mask_width or B > self.max_batch:
                raise EngineLimitError(
                    f"attention mask of {B} x {S} exceeds the engines' limits ({self.max_batch} x "
                    f"{self._mask_width}); rebuild with larger --max-batch / --max-seq / --max-prompt")
            buf = self._mask_buffers.get(dtype)
            if buf is None:
                buf = self._mask_buffers[dtype] = torch.empty(self.max_batch * self._mask_width,
                                                              dtype=dtype, device=self._device.device)
            view = buf[: B * S].view(B, S)
            view.copy_(torch.from_numpy(np.ascontiguousarray(attention_mask)).to(dtype))
            self._mask_views[dtype] = view
        return view

    def _as_device(self, hidden):
        """The hidden states as a contiguous device tensor of the engines' dtype."""
        torch = self._device.torch
        if isinstance(hidden, torch.Tensor) and hidden.device == self._device.device \
                and hidden.dtype == self._act_dtype and hidden.is_contiguous():
            return hidden
        return torch.as_tensor(np.asarray(hidden)).to(self._device.device, self._act_dtype).contiguous()

    def _out_hidden(self, x, shape):
        """A hidden buffer that is not ``x``'s storage, viewed as ``shape``."""
        buf = self._hidden[1] if x.data_ptr() == self._hidden[0].data_ptr() else self._hidden[0]
        return buf[: _volume(shape)].view(shape)

    # -- Backend -----------------------------------------------------------------------------

    def embed(self, input_ids, attention_mask):
        B, T = input_ids.shape  # (B, T) int64 from the engine
        if T > self.max_prompt:  # the prefill profile and the hidden buffers end there
            raise EngineLimitError(
                f"prompt of {T} tokens (padded) exceeds max_prompt {self.max_prompt} of the engines "
                f"in {self.engine_dir}; shorten it, or rebuild with `python -m engines build "
                f"{self.directory} --max-prompt {T}` (and --max-seq >= prompt + new tokens)")
        runner = self._runners["embed"]
        spec = self.manifest.embed
        torch = self._device.torch
        with self._device.scope():
            ids = self._ids[: B * T].view(B, T)
            ids.copy_(torch.from_numpy(np.ascontiguousarray(input_ids)).to(ids.dtype))
            mask = self._mask(attention_mask, runner.dtype(spec.inputs[1].name))
            out = self._hidden[0][: B * T * self._d].view(B, T, self._d)
            runner.run({spec.inputs[0].name: ids, spec.inputs[1].name: mask},
                       {spec.outputs[0].name: out}, self._device.handle)
        return out  # (B, T, D) on the device

    def layer(self, index, hidden, attention_mask, past_key, past_value):
        spec = self.manifest.layers[index]
        runner = self._runners[spec.name]
        h_in, m_in, k_in, v_in = (t.name for t in spec.inputs)
        h_out, k_out, v_out = (t.name for t in spec.outputs)
        with self._device.scope():
            x = self._as_device(hidden)  # (B, T, D)
            B, T, _ = x.shape
            mask = self._mask(attention_mask, runner.dtype(m_in))  # (B, W + T)
            out = self._out_hidden(x, (B, T, self._d))
            shape = (B, self._nh, T, self._hd)
            new_key = self._new[0][: _volume(shape)].view(shape)  # (B, nh, T, hd)
            new_value = self._new[1][: _volume(shape)].view(shape)
            # past_*: the KV cache's block of rows, contiguous (B, nh, hd, W) / (B, nh, W, hd): in place
            runner.run({h_in: x, m_in: mask, k_in: past_key, v_in: past_value},
                       {h_out: out, k_out: new_key, v_out: new_value},
                       self._device.handle, prefer=DECODE if T == 1 else PREFILL)
        return out, new_key, new_value  # the cache writes new_* before the next layer reuses them

    def keep(self, update, out, hidden):
        with self._device.scope():  # skipped rows keep their hidden state
            keep = self._upload(np.flatnonzero(~np.asarray(update, dtype=bool)))
            out.index_copy_(0, keep, self._as_device(hidden).index_select(0, keep))  # (K, T, D)
        return out

    def head(self, hidden, rows=None):
        torch = self._device.torch
        with self._device.scope():
            logits = self._head(hidden, rows)  # (R, V) on the device
            # (R, V) fp32 in fresh host memory (the caller keeps it; the buffer is reused next step)
            result = logits.to("cpu", torch.float32, copy=True).numpy()
        return result

    def decode(self, step: DecodeStep, cache: KVCache) -> np.ndarray:
        """``run_decode``; a step of greedy rows (``step.argmax``) takes their argmax on the device
        and brings back 8 bytes a row, not the logits."""
        if not step.argmax:
            return run_decode(self, step, cache)
        hidden = decode_hidden(self, step, cache)  # (R, 1, D)
        with self._device.scope():
            return self._head(hidden, None).argmax(-1).cpu().numpy()  # (R,) int64

    def verify(self, check: VerifyPass, cache: KVCache) -> np.ndarray:
        """``run_verify``, its head over every position at once (``head_all``); greedy rows
        (``check.argmax``) take each position's argmax on the device, one copy of (n, T) ids at the end."""
        if not check.argmax:
            return run_verify(self, check, cache)
        hidden = verify_hidden(self, check, cache)  # (R, T, D)
        with self._device.scope():
            ids = self._head_positions(hidden, check.verified, lambda logits: logits.argmax(-1))  # (n T,)
            return ids.view(len(check.verified), -1).cpu().numpy()  # (n, T) int64

    def head_all(self, hidden, rows):
        """Every position of ``rows`` (a verify pass's): (n, T, V) fp32 on the host."""
        torch = self._device.torch
        with self._device.scope():
            logits = self._head_positions(hidden, rows, lambda part: part.to("cpu", torch.float32, copy=True))
        return logits.view(len(rows), -1, self._v).numpy()  # (n, T, V)

    def _head_positions(self, hidden, rows, keep):
        """The head engine over every position of ``rows`` (hidden (B, T, D)), as rows of up to
        max_batch positions a run: a verify pass of n rows x T positions takes ceil(n T / max_batch)
        runs, not T (at batch 1 the head's weights, a quarter of Llama-3.2-1B's bytes, are read once
        a pass, not once a token). ``keep(logits (r, V))`` -> what to keep of a run, taken before the
        next run reuses the buffer; -> the kept parts, concatenated. Inside the device's scope."""
        torch = self._device.torch
        x = self._as_device(hidden)  # (B, T, D)
        picked = x.index_select(0, self._upload(np.asarray(rows)))  # (n, T, D)
        flat = picked.reshape(-1, self._d)  # (n T, D): each position a row of the head's input
        parts = [keep(self._run_head(flat[start:start + self.max_batch, None, :]))
                 for start in range(0, flat.shape[0], self.max_batch)]
        return torch.cat(parts)  # (n T, ...)

    def _head(self, hidden, rows):
        """The head engine over the last position of ``rows`` (None = all): its logits (R, V) on the
        device, in the buffer the next call reuses. Inside the device's scope."""
        x = self._as_device(hidden)  # (B, T, D)
        last = x[:, -1:, :]  # (B, 1, D): only the next token's logits are needed
        if rows is not None:  # the rows' last positions, gathered on the device: (R, 1, D)
            last = self._device.torch.index_select(last, 0, self._upload(np.asarray(rows)))
        return self._run_head(last)

    def _run_head(self, last):
        """The head engine over ``last`` (R, 1, D), R <= max_batch, copied into its input buffer
        -> its logits (R, V) on the device, in the buffer the next run reuses."""
        spec, R = self.manifest.head, last.shape[0]
        head_in = self._head_in[: R * self._d].view(R, 1, self._d)
        head_in.copy_(last)
        logits = self._logits[: R * self._v].view(R, 1, self._v)
        self._runners["head"].run({spec.inputs[0].name: head_in}, {spec.outputs[0].name: logits}, self._device.handle)
        return logits[:, 0, :]

    def close(self):
        self._runners.clear()
        self._engines.clear()
        if self.storage is not None:
            self.storage.close()
        self._hidden, self._mask_buffers = [], {}
        self._new = self._scratch = None


class StreamStorage(ArrayStorage):
    """The KV cache's torch buffers on the backend's device, every operation on its stream, the
    rows and capacity checked against the engines' limits."""

    def __init__(self, backend: TensorRTBackend):
        device = backend._device
        torch = device.torch
        super().__init__(len(backend.manifest.layers), backend._nh, backend._hd,
                         lambda shape: torch.zeros(shape, dtype=backend._act_dtype, device=device.device),
                         index=backend._upload, scope=device.scope)
        self.backend = backend

    def allocate(self, rows, capacity, width):
        b = self.backend
        b.check_limits(rows, min(capacity, b.max_seq))  # capacity: whole pages of a checked max_length
        super().allocate(rows, capacity, width)
