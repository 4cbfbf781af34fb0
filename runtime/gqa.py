"""The inputs of the fused layer graphs (export.fused): GroupQueryAttention's view of a call.

A plain layer graph reads the call's attention mask (R, W + T): the rows' valid past, then the new
positions, and derives RoPE positions and the causal, padding-aware bias from it inside every layer.
GroupQueryAttention instead writes each row's new K/V at the row's own length in the buffer it is
bound to, and reads absolute positions: what a call shares across its layers is computed here once
(numpy, no torch), from the mask and the rows' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kvcache import MASK_VALUE

FUSED_INPUTS = ("hidden_states", "attention_bias", "position_ids", "seqlens_k", "total_sequence_length",
                "query_seqlens", "past_key", "past_value")
FUSED_OUTPUTS = ("hidden_states_out", "present_key", "present_value")


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
            run = np.ones_like(self.length) if key is None else update.astype(np.int32)
            self._seqlens[key] = ((self.length + self.tokens * run - 1).astype(np.int32),
                                  (self.tokens * run).astype(np.int32))
        return self._seqlens[key]


def call_inputs(mask: np.ndarray, length: np.ndarray, tokens: int, width: int) -> CallInputs:
    """``mask`` (R, B + T): the call's attention mask as the plain graphs get it, its first B columns
    the rows' valid past (B: the bound width, or one page while the rows hold nothing), its last
    T = ``tokens`` the new positions; ``length`` (R,): each row's positions before the call;
    ``width``: the K/V buffers' width W, at least every row's length + T (runtime.kvcache).

    Each row's valid past lies inside its positions [0, length) (padding and unused positions are
    0) and GroupQueryAttention writes its new positions at [length, length + T): the absolute mask
    is the past's columns with the new ones placed at each row's length."""
    R, T = mask.shape[0], int(tokens)
    length = np.asarray(length, dtype=np.int32)
    past, new = mask[:, :-T], mask[:, -T:]  # (R, B), (R, T)
    valid = np.zeros((R, width), dtype=bool)
    valid[:, : min(past.shape[1], width)] = past[:, :width] != 0
    valid[np.arange(R)[:, None], length[:, None] + np.arange(T)] = new != 0
    bias = np.where(valid, np.float32(0), np.float32(MASK_VALUE))  # (R, W)
    bias = np.ascontiguousarray(np.broadcast_to(bias[:, None, None, :], (R, 1, T, width)))  # (R, 1, T, W)
    # as runtime.graph_ops.mask_positions: the valid positions before each new one, counted
    positions = (past.sum(axis=1, keepdims=True) + np.cumsum(new, axis=1)) * new - 1  # (R, T), padding -1
    return CallInputs(bias, np.maximum(positions, 0).astype(np.int64), np.array(width, dtype=np.int32),
                      length, T)


__all__ = ["CallInputs", "FUSED_INPUTS", "FUSED_OUTPUTS", "call_inputs"]
