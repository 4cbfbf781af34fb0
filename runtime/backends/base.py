"""The interface between the decode loop and whatever executes the graphs.

A backend owns the KV cache and knows nothing of policies. The cache is organised in *slots*: a
slot holds one sequence (one row of a request) with its own timeline of positions [0, capacity),
so rows that joined at different times sit side by side. The engine (runtime/engine.py) decides
which slot a row lives in, where its next positions go, and which layers each row runs; the
backend runs graphs over the rows it is given and writes only the new positions' K/V.

The two kinds of call:

- prefill: ``layer(i, hidden, mask, slots, positions=zeros)`` with a mask of width T (no past):
  the rows of one request, at any slots; their K/V go to positions [0, T).
- decode: ``layer(i, hidden, mask, all_slots, positions)`` with hidden (S, 1, D) for every slot
  (S = ``allocate``'s slots, empty ones included) and a mask of width ``past_width(n) + 1``.
  Row s's new K/V go to ``positions[s]``. Rows with ``update[s]`` False keep their hidden state
  and their K/V untouched, exactly as if they had skipped the layer (SkipDecode's per-row
  budgets); their cost is compute only, since the layer's weights are read once for all rows.

The engine makes a decode step one call, ``decode(ids, mask, positions, layers, updates, rows)``,
whose default is exactly embed, ``layer`` for each of ``layers``, head. A backend that can run the
whole step at once overrides it: the torch backend replays one CUDA graph per active-layer set
(backends/cuda_graphs.py); the ONNX Runtime IOBinding backend uploads the mask once per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Backend(ABC):
    name: str = "abstract"

    @abstractmethod
    def allocate(self, slots: int, capacity: int) -> None:
        """Preallocate every layer's K/V for ``slots`` rows of up to ``capacity`` positions each."""

    def limits(self) -> tuple[int | None, int | None]:
        """(most slots, most positions per slot) this backend can allocate; None = no limit of its own."""
        return None, None

    def past_width(self, length: int) -> int:
        """Past positions a decode step attends over when the longest row holds ``length``.

        The engine builds the attention mask this wide (0 beyond each row's own length). A paged
        backend rounds up to whole pages; the default is exact.
        """
        return length

    @abstractmethod
    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """input_ids (B, T) int64, attention_mask (B, P+T) int64 -> hidden states (B, T, D)."""

    @abstractmethod
    def layer(self, index: int, hidden, attention_mask: np.ndarray, slots: np.ndarray,
              positions: np.ndarray, update: np.ndarray | None = None):
        """Run decoder layer ``index`` over hidden (B, T, D) of the rows in ``slots`` (B,).

        attention_mask (B, P+T): the rows' past positions [0, P) (P = 0 for a prefill, else
        ``past_width``) then the T new ones. The new K/V of row b go to its positions
        [positions[b], positions[b] + T). ``update`` (B,) bool, None = all: rows that run the layer.
        Returns the new hidden states (B, T, D); rows not updated keep their input.
        """

    @abstractmethod
    def head(self, hidden, rows: np.ndarray | None = None) -> np.ndarray:
        """hidden (B, T, D) -> fp32 logits (len(rows), V) of the last position of ``rows`` (None = all)."""

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, positions: np.ndarray,
               layers: list[int], updates: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
        """One decode step over every slot: embed, layer ``layers[k]`` on the rows ``updates[k]``, head.

        input_ids (S, 1), attention_mask (S, past_width + 1), positions (S,) where each row's new
        K/V go, updates: one (S,) bool per layer, rows: the slots whose logits come back.
        Returns fp32 logits (len(rows), V).
        """
        hidden = self.embed(input_ids, attention_mask)  # (S, 1, D)
        slots = np.arange(len(input_ids))
        for index, update in zip(layers, updates):
            hidden = self.layer(index, hidden, attention_mask, slots, positions, update)
        return self.head(hidden, rows)

    def close(self) -> None:
        """Release sessions and device memory (nothing to do by default)."""
        return None


def check_slots(backend_name: str, slots: np.ndarray, past: int, total_slots: int, positions: np.ndarray,
                length: int, capacity: int, page: int = 1) -> None:
    """The shared preconditions of ``Backend.layer``: a past is bound for every slot in order, in
    whole pages of ``page`` positions (a paged backend), and every new position fits the capacity
    ``allocate`` gave."""
    if total_slots == 0:
        raise RuntimeError(f"{backend_name}: call allocate(slots, capacity) before running layers")
    if past and (len(slots) != total_slots or not np.array_equal(slots, np.arange(total_slots))):
        raise ValueError(f"{backend_name}: a decode step (past {past}) runs every slot in order; "
                         f"got slots {slots.tolist()} of {total_slots}")
    if past % page:
        raise ValueError(f"{backend_name}: a decode mask covers whole pages (past_width); got a "
                         f"past of {past} positions with pages of {page}")
    if len(positions) and int(np.max(positions)) + length > capacity:
        raise ValueError(f"{backend_name}: positions up to {int(np.max(positions)) + length} exceed "
                         f"the capacity {capacity} given to allocate()")
