"""Chains of fused layer graphs: the layers a call runs as one ONNX Runtime session.

A decode step runs its layers one session run each, and a run costs ~30 us outside its kernels
on a 2-core CPU (the executor's set-up, the first operator's cold start, the binding's own
work: docs/benchmarks.md, "One run for a step's layers"). A chain is one graph with the layers
of a call in order, each layer's hidden state feeding the next; its K/V inputs and outputs are
the layers', suffixed with their position in the chain (``past_key_0``, ``present_value_3``), and
the inputs every layer shares (export.fused) come once.

The layers' weights are not copied into the chains: every initializer is named after its layer
(``L7/mlp.down_proj...``), read in place from the artifact's weights file (a read-only memory map)
and added by name to each session of ONNX Runtime's C library, whose container keeps one packed
copy of each for all of them (runtime/backends/ort_capi.py): a chain costs its graph, not its
weights.
"""

from __future__ import annotations

import copy
import ctypes
import mmap
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..gqa import call_inputs
from . import ort_capi
from .fused_layers import SHAPES

SHARED_INPUTS = ("attention_bias", "position_ids", "seqlens_k", "total_sequence_length", "query_seqlens")


def _dtype(data_type: int) -> np.dtype:
    from onnx import helper
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))


class LayerGraphs:
    """An artifact's fused layer graphs, their weights in place, and sessions of any chain of them."""

    def __init__(self, directory, files: list[str], env: ort_capi.Environment):
        import onnx

        self.directory = Path(directory)
        self.env = env
        self._maps: dict[str, mmap.mmap] = {}  # weights file -> its read-only map
        self._layers = []  # per layer: its graph, initializers renamed after the layer
        self.values: dict[str, ort_capi.Value] = {}  # initializer name -> its weights in place
        for index, file in enumerate(files):
            graph = onnx.load(str(self.directory / file), load_external_data=False).graph
            rename = {t.name: f"L{index}/{t.name}" for t in graph.initializer}
            for t in graph.initializer:
                t.name = rename[t.name]
                self.values[t.name] = ort_capi.Value(self._array(t))
            for node in graph.node:
                node.input[:] = [rename.get(x, x) for x in node.input]
            self._layers.append(graph)
        self._opset = onnx.load(str(self.directory / files[0]), load_external_data=False).opset_import
        self.num_layers = len(files)
        self._sessions: dict[tuple[int, ...], ort_capi.Session] = {}

    def _array(self, tensor) -> np.ndarray:
        """An initializer's values where the artifact stores them (no copy)."""
        fields = {e.key: e.value for e in tensor.external_data}
        dtype, dims = _dtype(tensor.data_type), tuple(tensor.dims)
        if not fields:  # stored in the graph itself: small tensors
            from onnx import numpy_helper
            return np.ascontiguousarray(numpy_helper.to_array(tensor))
        file = fields["location"]
        if file not in self._maps:
            with open(self.directory / file, "rb") as f:
                self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = int(np.prod(dims, dtype=np.int64))
        return np.frombuffer(self._maps[file], dtype=dtype, count=count,
                             offset=int(fields.get("offset", 0))).reshape(dims)

    def chain_model(self, layers: tuple[int, ...]) -> bytes:
        """The serialized graph running ``layers`` in order (initializers without their data:
        the sessions take them from ``values``)."""
        from onnx import helper

        nodes, inputs, outputs, initializers = [], [], [], []
        previous = "hidden_states"
        for j, index in enumerate(layers):
            graph, last = self._layers[index], j == len(layers) - 1
            rename = {o: f"L{index}/{o}" for n in graph.node for o in n.output if o}
            rename.update(hidden_states=previous, past_key=f"past_key_{j}", past_value=f"past_value_{j}",
                          present_key=f"present_key_{j}", present_value=f"present_value_{j}",
                          hidden_states_out="hidden_states_out" if last else f"hidden_{j}")
            for node in graph.node:
                node = copy.copy(node)
                node.input[:] = [rename.get(x, x) for x in node.input]
                node.output[:] = [rename.get(x, x) for x in node.output]
                node.name = f"L{index}/{len(nodes)}"
                nodes.append(node)
            initializers += graph.initializer
            for arg in graph.input:
                if j and arg.name in ("hidden_states", *SHARED_INPUTS):
                    continue
                arg = copy.copy(arg)
                arg.name = rename.get(arg.name, arg.name)
                inputs.append(arg)
            for arg in graph.output:
                if arg.name == "hidden_states_out" and not last:
                    continue
                arg = copy.copy(arg)
                arg.name = rename[arg.name]
                outputs.append(arg)
            previous = rename["hidden_states_out"]
        model = helper.make_model(helper.make_graph(nodes, "chain", inputs, outputs, initializers),
                                  opset_imports=self._opset)
        return model.SerializeToString()

    def prepare(self, warmup_layers: int = 1) -> None:
        """Make the sessions a SkipDecode step can need up front (a session costs ~7 ms a layer to
        make, mostly its weights' packing, whose copy the container then drops): every top-k
        suffix's chains, the warm-up layers' and full depth's. Others (rows of one call running
        different layers) are made at first use."""
        L = self.num_layers
        wanted = {*pieces(0, L - 1, L), *pieces(0, min(warmup_layers, L) - 1, L)} if warmup_layers else set(pieces(0, L - 1, L))
        for k in range(1, L + 1):
            wanted.update(pieces(L - k, L - 1, L))
        # A session reads every weight of its layers to pack it (the container keys packed copies
        # by their bytes), so a chain of all the layers would touch the whole weights file at
        # once: its pages are dropped as it goes, not only after each session, and the peak stays
        # near the packed weights (a 16-layer chain of SmolLM2-360M int4 held 120 MB more).
        done = threading.Event()
        dropper = threading.Thread(target=self._drop_until, args=(done,), daemon=True)
        dropper.start()
        try:
            for chain in sorted(wanted):
                self.session(chain)
        finally:
            done.set()
            dropper.join()
        _trim_heap()

    def session(self, layers: tuple[int, ...]) -> ort_capi.Session:
        """The session of the chain ``layers`` (one layer: that layer's graph), made at first use."""
        session = self._sessions.get(layers)
        if session is None:
            names = [t.name for i in layers for t in self._layers[i].initializer]
            # the graph's initializers still name the artifact's weights file (ONNX Runtime checks
            # them against it) but come from the values added by name
            session = self.env.session(self.chain_model(layers), {n: self.values[n] for n in names},
                                       {"session.model_external_initializers_file_folder_path": str(self.directory)})
            self._sessions[layers] = session
            self._drop_pages()
        return session

    def _drop_until(self, done: threading.Event, every: float = 0.01) -> None:
        while not done.wait(every):
            self._drop_pages()

    def _drop_pages(self) -> None:
        """Unmap the weights' pages this process touched: the sessions hold their packed copies, and
        read the few tensors they use as stored (norms, scales) again from the page cache when they
        do. Without it the weights would stay resident twice, packed and as stored."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapped in self._maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)




def _trim_heap() -> None:
    """Give the heap's free memory back to the system where the C library can (glibc): making the
    sessions packs every weight once more and frees the copy, which leaves the heap fragmented."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def pieces(first: int, last: int, num_layers: int) -> list[tuple[int, ...]]:
    """The chains that run layers ``first..last`` (a contiguous run), bottom to top.

    SkipDecode runs the top k layers, k decaying: counted from the top, the run's layers are split
    at powers of two the way a binary number is (k = 19: 16, 2 and 1 layers from the top), so
    every k of a model of L layers takes at most log2(L) + 1 chains, and all of them together
    hold ~(L/2) log2(L) layers: few sessions, each made once (``LayerGraphs.prepare``)."""
    lo, hi = num_layers - 1 - last, num_layers - first  # the run as offsets from the top, [lo, hi)
    out = []
    while lo < hi:
        size = 1
        while lo % (size * 2) == 0 and lo + size * 2 <= hi:
            size *= 2
        out.append(tuple(range(num_layers - lo - size, num_layers - lo)))
        lo += size
    return out[::-1]


def runs(layers) -> list[tuple[int, int]]:
    """Ascending layer indices as (first, last) of each contiguous run."""
    out: list[list[int]] = []
    for index in layers:
        if out and index == out[-1][1] + 1:
            out[-1][1] = index
        else:
            out.append([index, index])
    return [(a, b) for a, b in out]


@dataclass
class _Shape:
    """The buffers and bindings of calls of one shape (as backends.fused_layers)."""

    key: tuple  # (storage id, start, rows, tokens, width)
    hidden: list  # two (R, T, D) arrays the chains alternate between
    bias: np.ndarray  # (R, 1, T, W) float32, rewritten each call
    positions: np.ndarray  # (R, T) int64, rewritten each call
    total: np.ndarray  # () int32: W
    seqlens_k: np.ndarray  # (R,) int32, rewritten where the rows that run a chain change
    query_seqlens: np.ndarray  # (R,) int32, likewise
    bindings: dict = field(default_factory=dict)  # (chain, direction) -> Binding; 0: hidden[0] -> hidden[1]


class ChainedLayers:
    """A call's layers as few session runs: each run of consecutive layers that the same rows run
    goes through the chains ``pieces`` splits it into; rows that skip them keep their state."""

    def __init__(self, graphs: LayerGraphs):
        self.graphs = graphs
        self._shapes: OrderedDict[tuple, _Shape] = OrderedDict()  # the last SHAPES, oldest first

    def _for(self, key: tuple, hidden: np.ndarray, call) -> _Shape:
        shape = self._shapes.get(key)
        if shape is not None:
            self._shapes.move_to_end(key)
            return shape
        R = hidden.shape[0]
        shape = _Shape(key, [np.empty_like(hidden), np.empty_like(hidden)], np.empty_like(call.attention_bias),
                       np.empty_like(call.position_ids), call.total_sequence_length.copy(),
                       np.empty(R, np.int32), np.empty(R, np.int32))
        self._shapes[key] = shape
        while len(self._shapes) > SHAPES:
            self._shapes.popitem(last=False)
        return shape

    def _bind(self, shape: _Shape, cache, chain: tuple, direction: int, start: int, stop: int):
        binding = self.graphs.session(chain).binding()
        for name, array in (("attention_bias", shape.bias), ("position_ids", shape.positions),
                            ("total_sequence_length", shape.total), ("seqlens_k", shape.seqlens_k),
                            ("query_seqlens", shape.query_seqlens)):
            binding.bind_input(name, ort_capi.Value(array))
        for j, index in enumerate(chain):
            key, value = cache.storage.past(index, start, stop)  # (R, nkv, W, hd): read, and written in place
            key, value = ort_capi.Value(key), ort_capi.Value(value)
            binding.bind_input(f"past_key_{j}", key)
            binding.bind_input(f"past_value_{j}", value)
            binding.bind_output(f"present_key_{j}", key)
            binding.bind_output(f"present_value_{j}", value)
        binding.bind_input("hidden_states", ort_capi.Value(shape.hidden[direction]))
        binding.bind_output("hidden_states_out", ort_capi.Value(shape.hidden[1 - direction]))
        shape.bindings[chain, direction] = binding
        return binding

    def run(self, cache, start: int, count: int, hidden, mask, layers, updates=None):
        """Layers ``layers`` over cache rows [start, start + count) (``Backend.run_layers``)."""
        if not len(layers):
            return hidden
        T, width, stop = hidden.shape[1], cache.width, start + count
        call = call_inputs(mask, cache.length[start:stop], T, width)
        shape = self._for((id(cache.storage), start, count, T, width), hidden, call)
        np.copyto(shape.bias, call.attention_bias)
        np.copyto(shape.positions, call.position_ids)
        np.copyto(shape.hidden[0], hidden)
        current = 0  # which of shape.hidden holds the state
        everyone = [True] * len(layers) if updates is None else np.asarray(updates).all(axis=1).tolist()
        groups: list[tuple[object, list[int]]] = []  # (rows that run them or None: all, layers)
        for k, index in enumerate(layers):
            update = None if everyone[k] else updates[k]
            if groups and (update is None) == (groups[-1][0] is None) and (
                    update is None or np.array_equal(update, groups[-1][0])):
                groups[-1][1].append(index)
            else:
                groups.append((update, [index]))
        for update, group in groups:
            seqlens_k, query_seqlens = call.seqlens(update)
            np.copyto(shape.seqlens_k, seqlens_k)
            np.copyto(shape.query_seqlens, query_seqlens)
            before = None if update is None else shape.hidden[current].copy()
            for first, last in runs(group):
                for chain in pieces(first, last, self.graphs.num_layers):
                    binding = shape.bindings.get((chain, current)) or self._bind(shape, cache, chain, current, start, stop)
                    self.graphs.session(chain).run_with_binding(binding)
                    current = 1 - current
            if update is not None:  # rows that skip the group keep their state
                np.copyto(shape.hidden[current], before, where=~update[:, None, None])
        # the buffers are the next call's: the caller gets its own
        return shape.hidden[current].copy()


__all__ = ["ChainedLayers", "LayerGraphs", "SHARED_INPUTS", "pieces", "runs"]
