"""The inputs of the fused layer graphs (export.fused): GroupQueryAttention's view of a call.

A plain layer graph reads the call's attention mask (R, W + T): the rows' valid past, then the new
positions, and derives RoPE positions and the causal, padding-aware bias from it inside every layer.
GroupQueryAttention instead writes each row's new K/V at the row's own length in the buffer it is
bound to, and reads absolute positions: what a call shares across its layers is computed here once
(numpy, no torch), from the mask and the rows' lengths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from .kvcache import MASK_VALUE

FUSED_INPUTS = ("hidden_states", "attention_bias", "position_ids", "seqlens_k", "total_sequence_length",
                "query_seqlens", "past_key", "past_value")
FUSED_OUTPUTS = ("hidden_states_out", "present_key", "present_value")


@functools.lru_cache(maxsize=None)
def why_unsupported() -> str | None:
    """Why the installed onnxruntime cannot run the fused layer graphs (None: it can). They give
    GroupQueryAttention a ``query_seqlens`` input (the tokens a row runs in a call: 0 where the row
    skips the layer), which older releases' operator lacks (1.30's takes 16 inputs, 1.32's 17): a
    session of them fails there with "has input size 17 not in range [min=7, max=16]"."""
    import onnxruntime
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    schemas = [s for s in capi.get_all_operator_schema()
               if s.name == "GroupQueryAttention" and s.domain == "com.microsoft"]
    if any(i.name == "query_seqlens" for s in schemas for i in s.inputs):
        return None
    return (f"onnxruntime {onnxruntime.__version__}'s GroupQueryAttention takes no query_seqlens input, "
            f"which the fused layer graphs give it (0 for a row that skips the layer); upgrade "
            f"onnxruntime (1.32 has it) to run them")


@dataclass
class CallInputs:
    """What every layer of one call over R rows and T new tokens shares, at bound width W."""

    attention_bias: np.ndarray  # (R, 1, T, W) float32: 0 where a key position is valid, MASK_VALUE elsewhere
    position_ids: np.ndarray  # (R, T) int64: the plain graphs' positions (mask_positions), padding at 0
    total_sequence_length: np.ndarray  # () int32: W, the bound width (an upper bound of every row's length)
    length: np.ndarray  # (R,) int32: the positions each row held before the call
    tokens: int  # T
    _seqlens: dict = field(default_factory=dict)  # update pattern -> (seqlens_k, query_seqlens)

    def seqlens(self, update: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(seqlens_k, query_seqlens), both (R,) int32, for a layer that ``update`` (R,) bool rows run
        (None: all): a row that skips it keeps its K/V and count (query_seqlens 0)."""
        key = None if update is None else update.tobytes()
        if key not in self._seqlens:
            query = (np.full(len(self.length), self.tokens, dtype=np.int32) if update is None
                     else self.tokens * update.astype(np.int32))  # (R,) int32: new tokens a row runs
            self._seqlens[key] = (self.length + query - 1, query)
        return self._seqlens[key]


def call_inputs(mask: np.ndarray, length: np.ndarray, tokens: int, width: int) -> CallInputs:
    """``mask`` (R, B + T): the call's attention mask as the plain graphs get it, its first B columns
    the rows' valid past (B: the bound width, or one page while the rows hold nothing), its last
    T = ``tokens`` the new positions; ``length`` (R,): each row's positions before the call;
    ``width``: the K/V buffers' width W, at least every row's length + T (runtime.kvcache).

    Each row's valid past lies inside its positions [0, length) (padding and unused positions are
    0) and GroupQueryAttention writes its new positions at [length, length + T): the absolute mask
    is the past's columns with the new ones placed at each row's length."""
    # Few numpy operations: a decode step runs this between two graph runs that flush the caches,
    # where each operation costs several times its warm time (0.15-0.2 ms a step at 5x on SmolLM2-135M
    # int4 went here, with 15 of them; docs/benchmarks.md, "Fewer operations between runs").
    R, T = mask.shape[0], int(tokens)
    length = np.asarray(length, dtype=np.int32)
    past, new = mask[:, :-T], mask[:, -T:]  # (R, B), (R, T)
    n = min(past.shape[1], width)
    bias = np.full((R, width), MASK_VALUE, dtype=np.float32)  # (R, W)
    bias[:, :n][past[:, :n] != 0] = 0
    cols = length[:, None] if T == 1 else length[:, None] + np.arange(T)  # (R, T): where the new ones go
    bias[np.arange(R)[:, None], cols] = np.where(new != 0, np.float32(0), np.float32(MASK_VALUE))
    if T == 1:
        bias = bias.reshape(R, 1, 1, width)  # a view
    else:
        bias = np.ascontiguousarray(np.broadcast_to(bias[:, None, None, :], (R, 1, T, width)))  # (R, 1, T, W)
    # as runtime.graph_ops.mask_positions: the valid positions before each new one, counted (padding at 0)
    counted = past.sum(axis=1, keepdims=True)  # (R, 1)
    positions = counted * new if T == 1 else np.maximum((counted + np.cumsum(new, axis=1)) * new - 1, 0)
    return CallInputs(bias, positions.astype(np.int64, copy=False), np.array(width, dtype=np.int32), length, T)


__all__ = ["CallInputs", "FUSED_INPUTS", "FUSED_OUTPUTS", "call_inputs", "why_unsupported"]
