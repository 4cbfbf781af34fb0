"""The ONNX Runtime backend's fused layer graphs (export.fused), run over a block of KV cache rows.

Each graph reads and writes the rows' K/V in place (its present bound to the past's buffers), so
the cache writes nothing; the inputs every layer of a call shares (runtime.gqa) are computed once
per call. At SmolLM2-360M int4 a layer's kernels take ~0.45 ms, and the Python between two runs
cost ~28 us a layer (it runs with cold caches after each run), so a layer's run is all that is
left per layer: for a call's shape (first row, rows, new tokens, KV width) each layer gets an
IOBinding per direction between the two hidden-state buffers the layers alternate between, made
the first time it is used, with everything bound once: the shared inputs and the row counts
(rewritten in place, the counts only where the rows that run a layer change) and the K/V buffers.
The bindings of the last few shapes are kept: a decode call and a joining row's prefill chunks
alternate step by step, and binding a layer anew costs ~80 us.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..gqa import call_inputs

_STALE = object()  # the row counts' pattern at the start of a call: rewrite them before the first layer
SHAPES = 4  # call shapes whose bindings are kept (a decode call's, a joining row's chunks, ...)


@dataclass
class _Shape:
    """The buffers and bindings of calls of one shape."""

    key: tuple  # (storage id, start, rows, tokens, width)
    hidden: list  # two (R, T, D) arrays the layers alternate between
    values: list  # their OrtValues
    bias: np.ndarray  # (R, 1, T, W) float32, rewritten each call
    positions: np.ndarray  # (R, T) int64, rewritten each call
    total: np.ndarray  # () int32: W
    seqlens_k: np.ndarray  # (R,) int32, rewritten where the pattern of rows that run a layer changes
    query_seqlens: np.ndarray  # (R,) int32, likewise
    pattern: object = _STALE  # whose row counts seqlens_k / query_seqlens hold now (update's bytes, None: all)
    bindings: dict = field(default_factory=dict)  # (layer, direction) -> IOBinding; 0: hidden[0] -> hidden[1]


class FusedLayers:
    def __init__(self, ort, sessions: list):
        self._ort = ort
        self._sessions = sessions  # per layer index
        self._shapes: OrderedDict[tuple, _Shape] = OrderedDict()  # the last SHAPES, oldest first

    def _for(self, key: tuple, hidden: np.ndarray, call) -> _Shape:
        shape = self._shapes.get(key)
        if shape is not None:
            self._shapes.move_to_end(key)
            return shape
        R = hidden.shape[0]
        buffers = [np.empty_like(hidden), np.empty_like(hidden)]
        shape = _Shape(key, buffers, [self._ort.OrtValue.ortvalue_from_numpy(b) for b in buffers],
                       np.empty_like(call.attention_bias), np.empty_like(call.position_ids),
                       call.total_sequence_length.copy(), np.empty(R, np.int32), np.empty(R, np.int32))
        self._shapes[key] = shape
        while len(self._shapes) > SHAPES:
            self._shapes.popitem(last=False)
        return shape

    def _bind(self, shape: _Shape, cache, index: int, direction: int, start: int, stop: int):
        """Layer ``index``'s binding reading shape.hidden[direction], writing the other."""
        key, value = cache.storage.past(index, start, stop)  # (R, nkv, W, hd) each: the past, and where
        # the graph writes the new positions
        binding = self._sessions[index].io_binding()
        for name, array in (("attention_bias", shape.bias), ("position_ids", shape.positions),
                            ("total_sequence_length", shape.total), ("seqlens_k", shape.seqlens_k),
                            ("query_seqlens", shape.query_seqlens), ("past_key", key), ("past_value", value)):
            binding.bind_cpu_input(name, array)
        for name, array in (("present_key", key), ("present_value", value)):
            binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        binding.bind_ortvalue_input("hidden_states", shape.values[direction])
        binding.bind_ortvalue_output("hidden_states_out", shape.values[1 - direction])
        shape.bindings[index, direction] = binding
        return binding

    def run(self, cache, start: int, count: int, hidden, mask, layers, updates=None):
        """Layers ``layers`` over cache rows [start, start + count) (``Backend.run_layers``)."""
        if not len(layers):
            return hidden
        T, width, stop = hidden.shape[1], cache.width, start + count
        call = call_inputs(mask, cache.length[start:stop], T, width)
        # the storage's buffers live as long as it does: the K/V views bound for a key stay valid
        shape = self._for((id(cache.storage), start, count, T, width), hidden, call)
        np.copyto(shape.bias, call.attention_bias)
        np.copyto(shape.positions, call.position_ids)
        np.copyto(shape.hidden[0], hidden)
        shape.pattern = _STALE  # the rows' lengths moved since the last call
        current = 0  # which of shape.hidden holds the state
        # the layers every row runs, found with one reduction rather than one a layer
        everyone = [True] * len(layers) if updates is None else np.asarray(updates).all(axis=1).tolist()
        for k, index in enumerate(layers):
            update = None if everyone[k] else updates[k]  # None: every row runs it
            pattern = None if update is None else update.tobytes()
            if pattern != shape.pattern:
                seqlens_k, query_seqlens = call.seqlens(update)
                np.copyto(shape.seqlens_k, seqlens_k)
                np.copyto(shape.query_seqlens, query_seqlens)
                shape.pattern = pattern
            binding = shape.bindings.get((index, current)) or self._bind(shape, cache, index, current, start, stop)
            self._sessions[index].run_with_iobinding(binding)
            if update is not None:  # rows that skip the layer keep their state
                np.copyto(shape.hidden[1 - current], shape.hidden[current], where=~update[:, None, None])
            current = 1 - current
        # the buffers are the next call's: the caller gets its own
        return shape.hidden[current].copy()


__all__ = ["FusedLayers"]
