"""The ONNX Runtime backend's fused layer graphs (export.fused), run over a block of KV cache rows.

Each graph reads and writes the rows' K/V in place (its present bound to the past's buffers), so
the cache writes nothing; the inputs every layer of a call shares (runtime.gqa) are computed once
per call. At SmolLM2-135M's size a layer's kernels take ~0.35 ms, so what Python does per layer
counts: each layer's IOBinding keeps what stays bound while the call's shape (first row, rows, new
tokens, KV width) stays the same (the shared inputs, written in place, and the K/V buffers), and
the hidden states alternate between two buffers bound as OrtValues. Per layer and step that leaves
the hidden states' two binds, the row counts' two and the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..gqa import call_inputs


@dataclass
class _Shape:
    """The buffers bound for calls of one shape; rebuilt when the shape changes."""

    key: tuple  # (start, rows, tokens, width)
    hidden: list  # two (R, T, D) arrays the layers alternate between
    values: list  # their OrtValues
    bias: np.ndarray  # (R, 1, T, W) float32, rewritten each call
    positions: np.ndarray  # (R, T) int64, rewritten each call
    total: np.ndarray  # () int32: W
    bound: set = field(default_factory=set)  # layers whose binding holds this shape's shared inputs


class FusedLayers:
    def __init__(self, ort, sessions: list):
        self._ort = ort
        self._sessions = sessions  # per layer index
        self._bindings = [s.io_binding() for s in sessions]
        self._shape: _Shape | None = None

    def _for(self, key: tuple, hidden: np.ndarray, call) -> _Shape:
        if self._shape is None or self._shape.key != key:
            buffers = [np.empty_like(hidden), np.empty_like(hidden)]
            self._shape = _Shape(key, buffers, [self._ort.OrtValue.ortvalue_from_numpy(b) for b in buffers],
                                 np.empty_like(call.attention_bias), np.empty_like(call.position_ids),
                                 call.total_sequence_length.copy())
        return self._shape

    def run(self, cache, start: int, count: int, hidden, mask, layers, updates=None):
        """Layers ``layers`` over cache rows [start, start + count) (``Backend.run_layers``)."""
        T, width, stop = hidden.shape[1], cache.width, start + count
        call = call_inputs(mask, cache.length[start:stop], T, width)
        shape = self._for((start, count, T, width), hidden, call)
        np.copyto(shape.bias, call.attention_bias)
        np.copyto(shape.positions, call.position_ids)
        current = hidden
        for k, index in enumerate(layers):
            update = None if updates is None or updates[k].all() else updates[k]  # None: every row runs it
            binding = self._bindings[index]
            if index not in shape.bound:
                key, value = cache.storage.past(index, start, stop)  # (R, nkv, W, hd) each: the past, and
                # where the graph writes the new positions
                for name, array in (("attention_bias", shape.bias), ("position_ids", shape.positions),
                                    ("total_sequence_length", shape.total), ("past_key", key),
                                    ("past_value", value)):
                    binding.bind_cpu_input(name, array)
                for name, array in (("present_key", key), ("present_value", value)):
                    binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
                shape.bound.add(index)
            seqlens_k, query_seqlens = call.seqlens(update)
            binding.bind_cpu_input("seqlens_k", seqlens_k)
            binding.bind_cpu_input("query_seqlens", query_seqlens)
            into = 1 if current is shape.hidden[0] else 0
            if current is shape.hidden[1 - into]:
                binding.bind_ortvalue_input("hidden_states", shape.values[1 - into])
            else:
                binding.bind_cpu_input("hidden_states", current)
            binding.bind_ortvalue_output("hidden_states_out", shape.values[into])
            self._sessions[index].run_with_iobinding(binding)
            out = shape.hidden[into]
            if update is not None:  # rows that skip the layer keep their state
                np.copyto(out, current, where=~update[:, None, None])
            current = out
        # the buffers are the next call's: the caller gets its own
        return current.copy() if current is not hidden else current


__all__ = ["FusedLayers"]
