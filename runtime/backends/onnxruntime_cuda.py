"""ONNX Runtime with IOBinding: ids, hidden states and the KV cache stay on the device.

``OnnxRuntimeBackend`` hands numpy arrays to ``session.run``, so on the CUDA provider every layer
call would copy its hidden states, mask and the whole bound past to the GPU and its outputs back.
Here every graph runs with ``run_with_iobinding``: the hidden states pass from graph to graph as
device ``OrtValue``s, each layer's K/V live in one device buffer of the page-major layout
(max_pages, slots, nh, hd|page, page|hd) whose first pages are bound as the past by address and
shape (no copy), the mask goes to the device once per decode step, and only the logits of the
rows asked for come back to the host.

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

The flat index of element (page p, slot s, head h, dim d, offset o) splits into a per-(row,
position) base, computed on the host (R x T int64: a few bytes per step), plus a constant
per-(h, d) grid (``kv_grids``, uploaded once). Rows a layer skips are simply not scattered; their
hidden states are kept by a ``Where`` graph. The helper graphs depend on the dtype only and ship in
``iobinding_graphs/``, so this backend needs onnxruntime, not the onnx package.

``device="cpu"`` runs all of this on the CPU provider (IOBinding with 'cpu' OrtValues): slower
than ``OnnxRuntimeBackend`` there, and meant for the tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SkipDecodeError
from ..manifest import Manifest
from .base import check_slots
from .onnxruntime import OnnxRuntimeBackend, _import_ort

_PROVIDER = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
_ONNX_TYPE = {"float32": 1, "float16": 10}  # TensorProto.FLOAT, FLOAT16
_OPSET = 17


class IOBindingDeviceError(SkipDecodeError, ValueError):
    """A device the IOBinding backend cannot bind, or whose provider this ONNX Runtime lacks."""


HELPER_GRAPHS = Path(__file__).with_name("iobinding_graphs")  # shipped: the runtime needs no onnx
HELPERS = ("scatter", "keep", "last")
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
    return {k: helper.make_model(g, ir_version=_IR_VERSION, producer_name="skipdecode-edge",
                                 opset_imports=[helper.make_opsetid("", _OPSET)]).SerializeToString()
            for k, g in graphs.items()}


def write_helper_graphs() -> None:
    """Rewrite the shipped helper graphs (after changing ``build_helper_graphs``)."""
    HELPER_GRAPHS.mkdir(exist_ok=True)
    for dtype in _ONNX_TYPE:
        for name, data in build_helper_graphs(dtype).items():
            helper_graph_file(name, dtype).write_bytes(data)


def kv_grids(nh: int, hd: int, page: int) -> dict[str, np.ndarray]:
    """Flat offset of (head h, dim d) within one (page, slot) cell of the K and V buffers: (1, nh, 1, hd)."""
    h, d = np.arange(nh)[:, None], np.arange(hd)[None, :]
    return {"k": (h * (hd * page) + d * page)[None, :, None, :],  # K (p, s, h, d, o): o innermost
            "v": (h * (page * hd) + d)[None, :, None, :]}  # V (p, s, h, o, d): d innermost


class OnnxRuntimeIOBindingBackend(OnnxRuntimeBackend):
    name = "onnxruntime"

    def __init__(self, directory, manifest: Manifest, device: str = "cuda", providers: list | None = None,
                 threads: int | None = None):
        ort = _import_ort()
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
        super().__init__(directory, manifest, providers=providers, threads=threads)
        self._bindings = {name: s.io_binding() for name, s in self._sessions.items()}
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self._helpers = {k: ort.InferenceSession(str(helper_graph_file(k, manifest.dtype)), opts,
                                                 providers=providers) for k in HELPERS}
        self._helper_bindings = {k: s.io_binding() for k, s in self._helpers.items()}
        self._ort = ort
        self._grids = {k: self._to_device(g) for k, g in kv_grids(self._nh, self._hd, self._page).items()}
        self._zero_key = self._zero_value = None  # (1, slots, ...) device zeros: a prefill's empty past

    # -- device memory ---------------------------------------------------------------------

    def _to_device(self, array: np.ndarray):
        """An OrtValue on the device holding ``array``'s values (on the CPU: wrapping its memory)."""
        return self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device_type,
                                                      self.device_id)

    def _on_device(self, hidden):
        return hidden if isinstance(hidden, self._ort.OrtValue) else self._to_device(hidden)

    def _bind(self, binding, name: str, buffer, shape) -> None:
        """Bind the first elements of ``buffer`` (an OrtValue) as input ``name`` of ``shape``."""
        binding.bind_input(name, self.device_type, self.device_id, self._dtype.type, list(shape),
                           buffer.data_ptr())

    def allocate(self, slots: int, capacity: int) -> None:
        pages = -(-capacity // self._page)
        nh, hd, page = self._nh, self._hd, self._page
        # np.zeros maps lazily, so only the copy to the device touches it; a device buffer from
        # ortvalue_from_shape_and_type would hold whatever was there, and a NaN in a masked past
        # position still poisons attention (NaN + mask bias is NaN).
        self.keys = [self._to_device(np.zeros((pages, slots, nh, hd, page), self._dtype))
                     for _ in self._layer_names]
        self.values = [self._to_device(np.zeros((pages, slots, nh, page, hd), self._dtype))
                       for _ in self._layer_names]
        self._zero_key = self._to_device(np.zeros((1, slots, nh, hd, page), self._dtype))
        self._zero_value = self._to_device(np.zeros((1, slots, nh, page, hd), self._dtype))
        self.slots, self.capacity = slots, pages * page

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

    def layer(self, index, hidden, attention_mask, slots, positions, update=None):
        B, T = hidden.shape()[:2] if isinstance(hidden, self._ort.OrtValue) else hidden.shape[:2]
        past = attention_mask.shape[1] - T
        check_slots(self.name, slots, past, self.slots, positions, T, self.capacity, self._page)
        if not past:  # prefill: one all-masked page stands for the empty past
            attention_mask = np.concatenate([np.zeros((B, self._page), np.int64), attention_mask], axis=1)
        return self._layer(index, self._on_device(hidden), self._to_device(attention_mask), past, B, T,
                           slots, positions, update)

    def _layer(self, index, hidden, mask, past, B, T, slots, positions, update):
        name = self._layer_names[index]
        b = self._bindings[name]
        b.bind_ortvalue_input("hidden_states", hidden)
        b.bind_ortvalue_input("attention_mask", mask)
        nh, hd, page = self._nh, self._hd, self._page
        if past:  # the buffers' first pages, by address: page-major, so they are contiguous
            n = past // page
            self._bind(b, "past_key", self.keys[index], (n, B, nh, hd, page))
            self._bind(b, "past_value", self.values[index], (n, B, nh, page, hd))
        else:
            self._bind(b, "past_key", self._zero_key, (1, B, nh, hd, page))
            self._bind(b, "past_value", self._zero_value, (1, B, nh, page, hd))
        out, new_key, new_value = self._run(self._sessions[name], b)  # new_*: (B, nh, T, hd)
        rows = np.arange(B) if update is None else np.flatnonzero(update)
        if len(rows):
            pos = positions[rows][:, None] + np.arange(T)  # (R, T): the updated rows' new positions
            cell = (pos // page * self.slots + slots[rows][:, None]) * (nh * hd * page)  # (R, T)
            offset = pos % page
            self._scatter("k", self.keys[index], new_key, rows, cell + offset)
            self._scatter("v", self.values[index], new_value, rows, cell + offset * hd)
        if update is not None and not update.all():
            k = self._helper_bindings["keep"]
            k.bind_cpu_input("update", np.ascontiguousarray(update, dtype=bool))
            k.bind_ortvalue_input("out", out)
            k.bind_ortvalue_input("hidden", hidden)
            out = self._run(self._helpers["keep"], k)[0]
        return out

    def _scatter(self, which: str, buffer, new, rows: np.ndarray, base: np.ndarray) -> None:
        """Write ``new[rows]`` into ``buffer`` in place: its output is bound to its own address."""
        b = self._helper_bindings["scatter"]
        size = int(np.prod(buffer.shape()))
        self._bind(b, "cache", buffer, (size,))
        b.bind_ortvalue_input("grid", self._grids[which])
        b.bind_ortvalue_input("new", new)
        b.bind_cpu_input("rows", rows.astype(np.int64))
        b.bind_cpu_input("base", np.ascontiguousarray(base, dtype=np.int64))
        b.bind_output("written", self.device_type, self.device_id, self._dtype.type, [size], buffer.data_ptr())
        self._helpers["scatter"].run_with_iobinding(b)

    def head(self, hidden, rows=None):
        hidden = self._on_device(hidden)
        rows = np.arange(hidden.shape()[0]) if rows is None else np.asarray(rows)
        last = self._helper_bindings["last"]
        last.bind_ortvalue_input("hidden", hidden)
        last.bind_cpu_input("rows", rows.astype(np.int64))
        picked = self._run(self._helpers["last"], last)[0]  # (R, 1, D) on the device
        b = self._bindings["head"]
        b.bind_ortvalue_input("hidden_states", picked)
        logits = self._run(self._sessions["head"], b, outputs_to="cpu")[0]  # (R, 1, V) on the host
        return logits.numpy()[:, -1, :].astype(np.float32)

    def decode(self, input_ids, attention_mask, positions, layers, updates, rows):
        S = len(input_ids)
        past = attention_mask.shape[1] - 1
        check_slots(self.name, np.arange(S), past, self.slots, positions, 1, self.capacity, self._page)
        mask = self._to_device(attention_mask)  # once per step, bound by every layer
        hidden = self.embed(input_ids, mask)  # (S, 1, D) on the device
        slots = np.arange(S)
        for index, update in zip(layers, updates):
            hidden = self._layer(index, hidden, mask, past, S, 1, slots, positions, update)
        return self.head(hidden, rows)

    def close(self):
        super().close()
        self._helpers.clear()
        self._bindings, self._helper_bindings, self._grids = {}, {}, {}
        self._zero_key = self._zero_value = None


__all__ = ["IOBindingDeviceError", "OnnxRuntimeIOBindingBackend"]
