"""The interface between the decode loop and whatever executes the graphs.

A backend owns the KV cache (so it can keep it in device memory or in preallocated buffers) and
knows nothing of policies: the decode loop tells it which layer to run and when a layer's cache
can be released because the layer will not run again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Backend(ABC):
    name: str = "abstract"

    @abstractmethod
    def reset(self, batch_size: int, max_length: int) -> None:
        """Start a new batch: drop every layer's cache; ``max_length`` = prompt + new tokens."""

    @abstractmethod
    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """input_ids (B, T) int64, attention_mask (B, P+T) int64 -> hidden states (B, T, D)."""

    @abstractmethod
    def layer(self, index: int, hidden, attention_mask: np.ndarray):
        """Run decoder layer ``index`` over hidden (B, T, D), appending its K/V to its cache."""

    @abstractmethod
    def head(self, hidden) -> np.ndarray:
        """hidden (B, T, D) -> fp32 logits (B, V) of the last position."""

    @abstractmethod
    def release(self, index: int) -> None:
        """Free layer ``index``'s cache: it will not run again in this batch."""

    @abstractmethod
    def cache_length(self, index: int) -> int:
        """Positions held in layer ``index``'s cache (0 when released or never run)."""

    def close(self) -> None:
        """Release sessions and device memory (nothing to do by default)."""
        return None


class CacheReleasedError(RuntimeError):
    """A layer ran after the decode loop released its cache: the policy's active sets were not nested."""
