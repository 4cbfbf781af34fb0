"""The ONNX Runtime backend's fused layer graphs (export.fused), run over a block of KV cache rows.

Each graph reads and writes the rows' K/V in place (its present bound to the past's buffers), so
the cache writes nothing; the inputs every layer of a call shares (runtime.gqa) are computed once
per call. At SmolLM2-360M int4 a layer's kernels take ~0.45 ms, and the Python between two runs
cost ~28 us a layer (it runs with cold caches after each run), so a layer's run is all that is
left per layer: for a call's shape (first row, rows, new tokens, KV width) every layer holds two
IOBindings, one per direction between the two hidden-state buffers the layers alternate between,
with everything bound once: the shared inputs and the row counts (rewritten in place, the counts
only where the rows that run a layer change) and the K/V buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..gqa import call_inputs

_STALE = object()  # the row counts' pattern at the start of a call: rewrite them before the first layer


@dataclass
class _Shape:
    """The buffers bound for calls of one shape; rebuilt when the shape changes."""

    key: tuple  # (start, rows, tokens, width)
    hidden: list  # two (R, T, D) arrays the layers alternate between
    bias: np.ndarray  # (R, 1, T, W) float32, rewritten each call
    positions: np.ndarray  # (R, T) int64, rewritten each call
    total: np.ndarray  # () int32: W
    seqlens_k: np.ndarray  # (R,) int32, rewritten where the pattern of rows that run a layer changes
    query_seqlens: np.ndarray  # (R,) int32, likewise
    pattern: object = _STALE  # whose row counts seqlens_k / query_seqlens hold now (update's bytes, None: all)
    bound: set = field(default_factory=set)  # layers whose two bindings hold this shape's buffers


class FusedLayers:
    def __init__(self, ort, sessions: list):
        self._ort = ort
        self._sessions = sessions  # per layer index
        # per layer: [hidden[0] -> hidden[1], hidden[1] -> hidden[0]]
        self._bindings = [(s.io_binding(), s.io_binding()) for s in sessions]
        self._shape: _Shape | None = None

    def _for(self, key: tuple, hidden: np.ndarray, call) -> _Shape:
        if self._shape is None or self._shape.key != key:
            R = hidden.shape[0]
            self._shape = _Shape(key, [np.empty_like(hidden), np.empty_like(hidden)],
                                 np.empty_like(call.attention_bias), np.empty_like(call.position_ids),
                                 call.total_sequence_length.copy(), np.empty(R, np.int32), np.empty(R, np.int32))
        return self._shape

    def _bind(self, shape: _Shape, cache, index: int, start: int, stop: int) -> None:
        key, value = cache.storage.past(index, start, stop)  # (R, nkv, W, hd) each: the past, and where
        # the graph writes the new positions
        values = [self._ort.OrtValue.ortvalue_from_numpy(h) for h in shape.hidden]
        for direction, binding in enumerate(self._bindings[index]):
            for name, array in (("attention_bias", shape.bias), ("position_ids", shape.positions),
                                ("total_sequence_length", shape.total), ("seqlens_k", shape.seqlens_k),
                                ("query_seqlens", shape.query_seqlens), ("past_key", key), ("past_value", value)):
                binding.bind_cpu_input(name, array)
            for name, array in (("present_key", key), ("present_value", value)):
                binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
            binding.bind_ortvalue_input("hidden_states", values[direction])
            binding.bind_ortvalue_output("hidden_states_out", values[1 - direction])
        shape.bound.add(index)

    def run(self, cache, start: int, count: int, hidden, mask, layers, updates=None):
        """Layers ``layers`` over cache rows [start, start + count) (``Backend.run_layers``)."""
        if not len(layers):
            return hidden
        T, width, stop = hidden.shape[1], cache.width, start + count
        call = call_inputs(mask, cache.length[start:stop], T, width)
        shape = self._for((start, count, T, width), hidden, call)
        np.copyto(shape.bias, call.attention_bias)
        np.copyto(shape.positions, call.position_ids)
        np.copyto(shape.hidden[0], hidden)
        shape.pattern = _STALE  # the rows' lengths moved since the last call
        current = 0  # which of shape.hidden holds the state
        for k, index in enumerate(layers):
            update = None if updates is None or updates[k].all() else updates[k]  # None: every row runs it
            if index not in shape.bound:
                self._bind(shape, cache, index, start, stop)
            pattern = None if update is None else update.tobytes()
            if pattern != shape.pattern:
                seqlens_k, query_seqlens = call.seqlens(update)
                np.copyto(shape.seqlens_k, seqlens_k)
                np.copyto(shape.query_seqlens, query_seqlens)
                shape.pattern = pattern
            self._sessions[index].run_with_iobinding(self._bindings[index][current])
            if update is not None:  # rows that skip the layer keep their state
                np.copyto(shape.hidden[1 - current], shape.hidden[current], where=~update[:, None, None])
            current = 1 - current
        # the buffers are the next call's: the caller gets its own
        return shape.hidden[current].copy()


__all__ = ["FusedLayers"]
