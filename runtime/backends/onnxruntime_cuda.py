"""ONNX Runtime with IOBinding: ids, hidden states and the KV cache stay on the device.

``OnnxRuntimeBackend`` hands numpy arrays to ``session.run``, so on the CUDA provider every layer
call would copy its hidden states, mask and the whole bound past to the GPU and its outputs back.
Here every graph runs with ``run_with_iobinding``: the hidden states pass from graph to graph as
device ``OrtValue``s, each layer's K/V live in device buffers of the KV cache's layout (rows, nh,
hd|W, W|hd) whose block of running rows is bound as the past by address and shape (no copy), the
mask goes to the device once per decode step, and only the logits of the rows asked for come back
to the host (``OrtValueStorage``), or, for greedy rows, their argmax (an ``argmax`` helper graph).

Writing a step's new K/V into each row's own position needs an in-place scatter on the device,
which ONNX Runtime's Python API does not offer. Three ways were weighed:

- torch or cupy device tensors over the same memory (DLPack): would pull torch into the ONNX
  Runtime path, which must not need it, and cupy is one more GPU dependency.
- recomputing the whole buffer as a graph output: a copy of the cache per layer per step.
- a tiny ONNX graph, ``ScatterElements`` over the buffer seen as one flat vector, with its output
  bound to the very address of its input. ONNX Runtime's CPU and CUDA ScatterElements kernels
  copy data to output only when the two addresses differ, so the bound output makes it an
  in-place write of just the new elements. Chosen: it runs on the CPU provider too, so the tests
  here run the very code the GPU runs.

The flat index of element (row r, head h, dim d, position w) splits into a per-(row, position)
base, computed on the host (R x T int64: a few bytes per step), plus a per-(h, d) grid
(``kv_grids``, uploaded when the width changes). Rows a layer skips are simply not scattered;
their hidden states are kept by a ``Where`` graph. The cache's other two device operations are
helper graphs too, with their outputs bound where the data must go: ``copy`` (Identity) moves a
row, ``resize`` (Slice then Pad) re-lays the rows in use at a new width. The helper graphs depend
on the dtype only and ship in ``iobinding_graphs/``, so this backend needs onnxruntime, not the
onnx package.

``device="cpu"`` runs all of this on the CPU provider (IOBinding with 'cpu' OrtValues): slower
than ``OnnxRuntimeBackend`` there, and meant for the tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..artifact.manifest import Manifest
from ..errors import InvalidArgumentError, SkipDecodeError
from ..kvcache import KVCache, KVStorage
from .base import DecodeStep, VerifyPass, run_layers, run_verify, verify_hidden
from .onnxruntime import OnnxRuntimeBackend, import_ort, new_session_options

_PROVIDER = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
_ONNX_TYPE = {"float32": 1, "float16": 10}  # TensorProto.FLOAT, FLOAT16
_OPSET = 17


class IOBindingDeviceError(SkipDecodeError, ValueError):
    """A device the IOBinding backend cannot bind, or whose provider this ONNX Runtime lacks."""


HELPER_GRAPHS = Path(__file__).with_name("iobinding_graphs")  # shipped: the runtime needs no onnx
HELPERS = ("scatter", "keep", "last", "copy", "resize", "argmax")
_IR_VERSION = 8  # pinned, so the shipped bytes do not depend on the onnx that wrote them (ORT >= 1.14 reads 8)


def helper_graph_file(name: str, dtype: str) -> Path:
    return HELPER_GRAPHS / f"{name}_{dtype}.onnx"


def build_helper_graphs(dtype: str) -> dict[str, bytes]:
    """The helper graphs (serialized ModelProtos) for ``dtype``, written with the onnx package.

    The runtime reads the copies shipped in ``iobinding_graphs/`` instead (tests/runtime/
    test_onnxruntime_iobinding.py checks they are equal; ``write_helper_graphs()`` rewrites them).

    scatter: cache (N,) flat, new (B, nh, T, hd), rows (R,), base (R, T), grid (1, nh, 1, hd) ->
             cache (N,) with cache[base[r, t] + grid[0, h, 0, d]] = new[rows[r], h, t, d]
    keep: update (B,) bool, out (B, T, D), hidden (B, T, D) -> where(update, out, hidden)
    last: hidden (B, T, D), rows (R,) -> hidden[rows, -1:] (R, 1, D)
    copy: x (N,) -> y (N,) = x (bound at another address: a row moved)
    resize: x (a, b, c, d), ends (4,), pads (8,) -> Pad(Slice(x, 0, ends), pads) (re-laid at a new width)
    argmax: logits (R, T, V) -> ids (R, T) int64 (greedy rows' tokens: 8 bytes a position to the host)
    """
    from onnx import TensorProto, helper

    t = _ONNX_TYPE[dtype]
    value = helper.make_tensor_value_info
    graphs = {"scatter": helper.make_graph(
        [helper.make_node("Gather", ["new", "rows"], ["picked"], axis=0),  # (R, nh, T, hd)
         helper.make_node("Unsqueeze", ["base", "axes"], ["base4"]),  # (R, 1, T, 1)
         helper.make_node("Add", ["base4", "grid"], ["where4"]),  # (R, nh, T, hd)
         helper.make_node("Reshape", ["where4", "flat"], ["where"]),
         helper.make_node("Reshape", ["picked", "flat"], ["updates"]),
         helper.make_node("ScatterElements", ["cache", "where", "updates"], ["written"], axis=0)],
        "kv_scatter",
        [value("cache", t, ["N"]), value("new", t, ["B", "nh", "T", "hd"]),
         value("rows", TensorProto.INT64, ["R"]), value("base", TensorProto.INT64, ["R", "T"]),
         value("grid", TensorProto.INT64, [1, "nh", 1, "hd"])],
        [value("written", t, ["N"])],
        [helper.make_tensor("axes", TensorProto.INT64, [2], [1, 3]),
         helper.make_tensor("flat", TensorProto.INT64, [1], [-1])])}
    graphs["keep"] = helper.make_graph(
        [helper.make_node("Reshape", ["update", "col"], ["update3"]),
         helper.make_node("Where", ["update3", "out", "hidden"], ["kept"])], "keep_rows",
        [value("update", TensorProto.BOOL, ["B"]), value("out", t, ["B", "T", "D"]),
         value("hidden", t, ["B", "T", "D"])], [value("kept", t, ["B", "T", "D"])],
        [helper.make_tensor("col", TensorProto.INT64, [3], [-1, 1, 1])])
    graphs["last"] = helper.make_graph(
        [helper.make_node("Gather", ["hidden", "rows"], ["picked"], axis=0),
         helper.make_node("Slice", ["picked", "start", "end", "axis"], ["last"])], "last_position",
        [value("hidden", t, ["B", "T", "D"]), value("rows", TensorProto.INT64, ["R"])],
        [value("last", t, ["R", 1, "D"])],
        [helper.make_tensor("start", TensorProto.INT64, [1], [-1]),
         helper.make_tensor("end", TensorProto.INT64, [1], [np.iinfo(np.int64).max]),
         helper.make_tensor("axis", TensorProto.INT64, [1], [1])])
    graphs["copy"] = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "copy",
        [value("x", t, ["N"])], [value("y", t, ["N"])])
    graphs["resize"] = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends"], ["kept"]),
         helper.make_node("Pad", ["kept", "pads"], ["y"])], "resize",
        [value("x", t, ["a", "b", "c", "d"]), value("ends", TensorProto.INT64, [4]),
         value("pads", TensorProto.INT64, [8])], [value("y", t, ["A", "B", "C", "D"])],
        [helper.make_tensor("starts", TensorProto.INT64, [4], [0, 0, 0, 0])])
    graphs["argmax"] = helper.make_graph(
        [helper.make_node("ArgMax", ["logits"], ["ids"], axis=-1, keepdims=0)], "argmax",
        [value("logits", t, ["R", "T", "V"])], [value("ids", TensorProto.INT64, ["R", "T"])])
    return {k: helper.make_model(g, ir_version=_IR_VERSION, producer_name="skipdecode-edge",
                                 opset_imports=[helper.make_opsetid("", _OPSET)]).SerializeToString()
            for k, g in graphs.items()}


def write_helper_graphs() -> None:
    """Rewrite the shipped helper graphs (after changing ``build_helper_graphs``)."""
    HELPER_GRAPHS.mkdir(exist_ok=True)
    for dtype in _ONNX_TYPE:
        for name, data in build_helper_graphs(dtype).items():
            helper_graph_file(name, dtype).write_bytes(data)


def kv_grids(nh: int, hd: int, width: int) -> dict[str, np.ndarray]:
    """Flat offset of (head h, dim d) within one row's K and V at ``width`` positions: (1, nh, 1, hd)."""
    h, d = np.arange(nh)[:, None], np.arange(hd)[None, :]
    return {"k": (h * (hd * width) + d * width)[None, :, None, :],  # K (r, h, d, w): w innermost
            "v": (h * (width * hd) + d)[None, :, None, :]}  # V (r, h, w, d): d innermost


class Block:
    """Rows [start, stop) of a device buffer (rows, ...) as the graph binds them: address and shape."""

    def __init__(self, buffer, start: int, shape: tuple):
        self.buffer, self.start, self.shape = buffer, start, shape


class OrtValueStorage(KVStorage):
    """The KV cache's buffers as device OrtValues of the whole capacity, seen exactly ``width``
    wide (a block of rows is contiguous); moves, re-lays and writes run the helper graphs with
    their outputs bound in place."""

    def __init__(self, backend: "OnnxRuntimeIOBindingBackend"):
        self.b = backend
        self.keys: list = []  # per layer (rows, nh, hd, W): the first elements of the buffer
        self.values: list = []  # per layer (rows, nh, W, hd)
        self.rows = self.width = 0
        self.grids: dict = {}
        self.zeros = None  # (rows * nh * hd * page,) on the device: the past of rows holding nothing

    def _shapes(self, rows: int, width: int):
        nh, hd = self.b._nh, self.b._hd
        return (rows, nh, hd, width), (rows, nh, width, hd)

    def allocate(self, rows, capacity, width):
        self.keys, self.values = [], []
        # Zeros uploaded once: a device buffer from ortvalue_from_shape_and_type would hold
        # whatever was there, and a NaN in a masked past position still poisons attention
        # (NaN * 0 is NaN). np.zeros maps lazily, so only the copy to the device touches it.
        size = rows * self.b._nh * self.b._hd * capacity
        zeros = lambda: self.b._to_device(np.zeros(size, self.b._dtype))  # noqa: E731
        self.keys = [zeros() for _ in self.b._layer_names]
        self.values = [zeros() for _ in self.b._layer_names]
        self.rows, self.zeros = rows, None
        self._set_width(width)

    def _set_width(self, width: int) -> None:
        self.width = width
        self.grids = {k: self.b._to_device(g) for k, g in kv_grids(self.b._nh, self.b._hd, width).items()}

    def resize(self, width, used):
        if used:
            keep = min(width, self.width)
            old_k, old_v = self._shapes(used, self.width)
            new_k, new_v = self._shapes(used, width)
            for buffer in self.keys:  # re-laid into a scratch the graph allocates, then copied back
                self.b._resize(buffer, old_k, new_k, axis=3, keep=keep)
            for buffer in self.values:
                self.b._resize(buffer, old_v, new_v, axis=2, keep=keep)
        self._set_width(width)

    def empty(self, rows, width):
        n = rows * self.b._nh * self.b._hd * width
        if self.zeros is None or int(np.prod(self.zeros.shape())) < n:
            self.zeros = self.b._to_device(np.zeros(self.rows * self.b._nh * self.b._hd * width, self.b._dtype))
        k, v = self._shapes(rows, width)
        return Block(self.zeros, 0, k), Block(self.zeros, 0, v)  # K and V share it: both read-only

    def to_host(self) -> list[np.ndarray]:
        """Every layer's K, then every layer's V, as the graphs see them (at the current width),
        copied to the host: for tests and debugging."""
        k, v = self._shapes(self.rows, self.width)
        n = int(np.prod(k))
        return [b.numpy()[:n].reshape(k) for b in self.keys] + [b.numpy()[:n].reshape(v) for b in self.values]

    def move(self, src, dst, length):  # whole rows at the width: one copy a buffer
        row = self.b._nh * self.b._hd * self.width  # elements of one row of K, and of V
        for buffer in (*self.keys, *self.values):
            self.b._copy(buffer, src * row, buffer, dst * row, row)

    def past(self, layer, start, stop):
        n = stop - start
        row = self.b._nh * self.b._hd * self.width
        k, v = self._shapes(n, self.width)
        return Block(self.keys[layer], start * row, k), Block(self.values[layer], start * row, v)

    def write(self, layer, new_key, new_value, src, dst, positions):
        T = new_key.shape()[2]
        nh, hd, W = self.b._nh, self.b._hd, self.width
        pos = positions[:, None] + np.arange(T)  # (R, T)
        cell = dst[:, None] * (nh * hd * W)  # (R, 1): where each row starts
        self.b._scatter(self.keys[layer], new_key, src, cell + pos, self.grids["k"])
        self.b._scatter(self.values[layer], new_value, src, cell + pos * hd, self.grids["v"])

    def close(self):
        self.keys, self.values, self.grids, self.zeros = [], [], {}, None


class OnnxRuntimeIOBindingBackend(OnnxRuntimeBackend):
    name = "onnxruntime"
    looks_up_embeddings = False  # its hidden states live on the device: the embedding graph runs there
    narrows_rows = False  # (and its layers give OrtValues)

    def __init__(self, directory, manifest: Manifest, device: str = "cuda", providers: list | None = None,
                 threads: int | None = None, spin: bool = False,
                 huge_pages: bool = False, fused: bool | None = None):
        if fused:
            raise InvalidArgumentError(
                "fused=True: the IOBinding backend (device=...) runs the plain layer graphs; the fused ones "
                "run on the CPU backend: runtime.load(A, providers=['CPUExecutionProvider']) (--device cpu)")
        ort = import_ort()
        kind, _, index = str(device).partition(":")
        if kind not in _PROVIDER:
            raise IOBindingDeviceError(f"device={device!r}: the ONNX Runtime IOBinding backend binds "
                                       f"'cuda', 'cuda:N' or 'cpu'")
        if _PROVIDER[kind] not in ort.get_available_providers():
            raise IOBindingDeviceError(
                f"device={device!r} needs ONNX Runtime's {_PROVIDER[kind]}, which this onnxruntime "
                f"{ort.__version__} lacks (it has {ort.get_available_providers()}); install "
                f"onnxruntime-gpu instead of onnxruntime (never both), or use device='cpu'")
        self.device_type, self.device_id = kind, int(index or 0)
        if providers is None:  # ops a provider lacks fall back to the CPU, as ORT does by default
            providers = ([(_PROVIDER[kind], {"device_id": self.device_id})] if kind == "cuda" else []) \
                + ["CPUExecutionProvider"]
        # the plain layer graphs: this backend's OrtValue storage and helper graphs keep K transposed
        super().__init__(directory, manifest, providers=providers, threads=threads, spin=spin,
                         huge_pages=huge_pages, fused=False)
        self._bindings = {name: s.io_binding() for name, s in self._sessions.items()}
        opts = new_session_options(ort)
        opts.log_severity_level = 3
        dtypes = {k: manifest.dtype for k in HELPERS} | {"argmax": manifest.head.outputs[0].dtype}  # over the logits
        self._helpers = {k: ort.InferenceSession(str(helper_graph_file(k, dtypes[k])), opts,
                                                 providers=providers) for k in HELPERS}
        self._helper_bindings = {k: s.io_binding() for k, s in self._helpers.items()}
        self._ort = ort

    # -- device memory ---------------------------------------------------------------------

    def _to_device(self, array: np.ndarray):
        """An OrtValue on the device holding ``array``'s values (on the CPU: wrapping its memory)."""
        return self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device_type,
                                                      self.device_id)

    def _on_device(self, hidden):
        return hidden if isinstance(hidden, self._ort.OrtValue) else self._to_device(hidden)

    def _bind(self, binding, name: str, buffer, shape, offset: int = 0) -> None:
        """Bind ``shape`` elements of ``buffer`` (an OrtValue) from element ``offset`` as input ``name``."""
        binding.bind_input(name, self.device_type, self.device_id, self._dtype.type, list(shape),
                           buffer.data_ptr() + offset * self._dtype.itemsize)

    def _bind_out(self, binding, name: str, buffer, shape, offset: int = 0) -> None:
        binding.bind_output(name, self.device_type, self.device_id, self._dtype.type, list(shape),
                            buffer.data_ptr() + offset * self._dtype.itemsize)

    def kv_storage(self) -> OrtValueStorage:
        return OrtValueStorage(self)

    # -- graphs ------------------------------------------------------------------------------

    def _run(self, session, binding, outputs_to: str | None = None) -> list:
        """Run with the inputs bound; outputs on the device (or ``outputs_to``), as OrtValues."""
        device, index = (outputs_to, 0) if outputs_to else (self.device_type, self.device_id)  # the host is device 0
        for out in session.get_outputs():
            binding.bind_output(out.name, device, index)
        session.run_with_iobinding(binding)
        return binding.get_outputs()

    def embed(self, input_ids, attention_mask):
        b = self._bindings["embed"]
        b.bind_ortvalue_input("input_ids", self._to_device(input_ids.astype(np.int64)))
        b.bind_ortvalue_input("attention_mask", self._on_device(attention_mask))
        return self._run(self._sessions["embed"], b)[0]  # (B, T, D) on the device

    def layer(self, index, hidden, attention_mask, past_key: Block, past_value: Block):
        name = self._layer_names[index]
        b = self._bindings[name]
        b.bind_ortvalue_input("hidden_states", self._on_device(hidden))
        b.bind_ortvalue_input("attention_mask", self._on_device(attention_mask))
        self._bind(b, "past_key", past_key.buffer, past_key.shape, past_key.start)  # in place
        self._bind(b, "past_value", past_value.buffer, past_value.shape, past_value.start)
        out, new_key, new_value = self._run(self._sessions[name], b)  # new_*: (B, nh, T, hd)
        return out, new_key, new_value

    def keep(self, update, out, hidden):
        k = self._helper_bindings["keep"]
        k.bind_cpu_input("update", np.ascontiguousarray(update, dtype=bool))
        k.bind_ortvalue_input("out", out)
        k.bind_ortvalue_input("hidden", self._on_device(hidden))
        return self._run(self._helpers["keep"], k)[0]

    def _scatter(self, buffer, new, rows: np.ndarray, base: np.ndarray, grid) -> None:
        """Write ``new[rows]`` into ``buffer`` in place: its output is bound to its own address."""
        b = self._helper_bindings["scatter"]
        size = int(np.prod(buffer.shape()))
        self._bind(b, "cache", buffer, (size,))
        b.bind_ortvalue_input("grid", grid)
        b.bind_ortvalue_input("new", new)
        b.bind_cpu_input("rows", rows.astype(np.int64))
        b.bind_cpu_input("base", np.ascontiguousarray(base, dtype=np.int64))
        self._bind_out(b, "written", buffer, (size,))
        self._helpers["scatter"].run_with_iobinding(b)

    def _copy(self, src, src_offset: int, dst, dst_offset: int, count: int) -> None:
        b = self._helper_bindings["copy"]
        self._bind(b, "x", src, (count,), src_offset)
        self._bind_out(b, "y", dst, (count,), dst_offset)
        self._helpers["copy"].run_with_iobinding(b)

    def _resize(self, buffer, old_shape, new_shape, axis: int, keep: int) -> None:
        """Re-lay the first elements of ``buffer`` from ``old_shape`` to ``new_shape`` (cut or
        zero-padded along ``axis``): into a scratch output, then copied back over the buffer."""
        b = self._helper_bindings["resize"]
        self._bind(b, "x", buffer, old_shape)
        ends = np.array(old_shape, dtype=np.int64)
        ends[axis] = keep
        pads = np.zeros(8, dtype=np.int64)
        pads[4 + axis] = new_shape[axis] - keep  # zeros after the kept positions
        b.bind_cpu_input("ends", ends)
        b.bind_cpu_input("pads", pads)
        scratch = self._run(self._helpers["resize"], b)[0]  # new_shape, on the device
        self._copy(scratch, 0, buffer, 0, int(np.prod(new_shape)))

    def head(self, hidden, rows=None):
        hidden = self._on_device(hidden)
        rows = np.arange(hidden.shape()[0]) if rows is None else np.asarray(rows)
        last = self._helper_bindings["last"]
        last.bind_ortvalue_input("hidden", hidden)
        last.bind_cpu_input("rows", rows.astype(np.int64))
        picked = self._run(self._helpers["last"], last)[0]  # (R, 1, D) on the device
        logits = self._head(picked, outputs_to="cpu")  # (R, 1, V) on the host
        return logits.numpy()[:, -1, :].astype(np.float32)

    def _head(self, hidden, outputs_to: str | None = None):
        """The head graph over ``hidden`` (R, T, D) on the device -> logits (R, T, V), an OrtValue on the
        device (or ``outputs_to``)."""
        b = self._bindings["head"]
        b.bind_ortvalue_input("hidden_states", hidden)
        return self._run(self._sessions["head"], b, outputs_to)[0]

    def _argmax(self, logits) -> np.ndarray:
        """``logits`` (R, T, V) on the device -> their argmax (R, T) int64 on the host: 8 bytes a
        position come back, not the logits."""
        b = self._helper_bindings["argmax"]
        b.bind_ortvalue_input("logits", logits)
        return self._run(self._helpers["argmax"], b, outputs_to="cpu")[0].numpy()

    def head_all(self, hidden, rows):
        host = self._on_device(hidden).numpy()  # (B, T, D) on the host: the plain backend's head, one run
        return super().head_all(host, rows)

    def decode(self, step: DecodeStep, cache: KVCache):
        mask = self._to_device(step.attention_mask)  # once per step, bound by every layer
        hidden = self.embed(step.input_ids, mask)  # (R, 1, D) on the device
        hidden = run_layers(self, cache, 0, step.rows, hidden, mask, step.layers, step.updates)
        if step.argmax:  # greedy rows: their ids, picked on the device
            return self._argmax(self._head(hidden))[:, -1]  # (R,) int64
        return self.head(hidden)

    def verify(self, check: VerifyPass, cache: KVCache):
        """``run_verify``; greedy rows (``check.argmax``) take every position's argmax on the device."""
        if not check.argmax:
            return run_verify(self, check, cache)
        hidden = verify_hidden(self, check, cache)  # (R, T, D) on the device
        # every row's head (the riding rows' too: no helper gathers rows of every position), the
        # verified rows' ids picked on the host
        return self._argmax(self._head(hidden))[check.verified]  # (n, T) int64

    def close(self):
        super().close()
        self._helpers.clear()
        self._bindings, self._helper_bindings = {}, {}


__all__ = ["IOBindingDeviceError", "OnnxRuntimeIOBindingBackend"]
