"""The interface between the decode loop and whatever executes the graphs.

A backend runs graphs and knows nothing of policies, rows or positions: the KV cache
(runtime/kvcache.py) owns the rows, their lengths and masks and the width a step binds, and the
backend gives it a ``KVStorage`` for its device. The engine (runtime/engine/) decides which rows
run which layers.

- ``embed(ids, mask)``, ``head(hidden, rows)``: the embedding and head graphs (``head_all``: every
  position's logits, for a lossless verify pass).
- ``layer(i, hidden, mask, past_key, past_value)``: run layer graph i over a block of rows whose
  past the cache binds, returning (hidden, new_key, new_value); the cache writes the new K/V.
- ``run_layers(cache, start, count, hidden, mask, layers, updates)``: a call's layers over a block
  of rows; by default each through ``layer``, the cache writing its new K/V; the ONNX Runtime
  backend's fused graphs (export.fused) write the cache themselves and override it.
- ``keep(update, out, hidden)``: per-row SkipDecode budgets: rows that skip a layer keep their
  hidden state (its cost for them is compute only; the layer's weights are read once for all rows).

A decode step is one call, ``decode(step, cache)``, whose default (``run_decode``) is exactly
embed, the step's layers, head over the decoding rows ``[0, step.rows)``. A backend that can run
the whole step at once overrides it: the torch backend replays one CUDA graph per active-layer set
(backends/cuda_graphs.py); the ONNX Runtime IOBinding backend uploads the mask once per step.
A lossless verify pass is one call too, ``verify(check, cache)`` (default ``run_verify``: embed,
every layer, ``head_all``), which the torch backend replays as a captured graph as well.

A step or pass whose rows need only their logits' argmax (``argmax``: greedy rows whose logits
nothing else reads, runtime.engine) may return the token ids instead of the logits; a backend
whose logits live on a device picks them there and copies back 8 bytes a row, not 4 V (the
torch backend's captured steps and passes, the TensorRT backend's, the ONNX Runtime IOBinding
backend's). ``tokens`` gives the ids from whichever came back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..kvcache import KVCache, KVStorage


@dataclass
class DecodeStep:
    """One token for each of the decoding rows [0, rows) of the KV cache."""

    input_ids: np.ndarray  # (R, 1) int64: the token each row runs
    attention_mask: np.ndarray  # (R, W + 1) int64: the rows' valid past, then the new position
    layers: list[int]  # the union of the rows' active sets, ascending
    updates: np.ndarray  # (len(layers), R) bool: per layer, the rows whose active set holds it
    draft: bool = False  # every row's logits are a lossless draft's: the backend may read its draft head
    argmax: bool = False  # the rows need only their logits' argmax: the backend may return ids (R,) int64

    @property
    def rows(self) -> int:
        return len(self.input_ids)


@dataclass
class VerifyPass:
    """A lossless verify pass: T tokens for each of the decoding rows [0, rows) at full depth."""

    input_ids: np.ndarray  # (R, T) int64: a verified row's first draft input and its drafts, then pad
    attention_mask: np.ndarray  # (R, W + T) int64: the rows' valid past, then the positions written
    updates: np.ndarray  # (R,) bool: the rows verified; the others ride along and write nothing
    verified: np.ndarray  # (n,) int64: the verified rows, whose logits come back
    depth: int  # the model's layers, all of which the pass runs
    argmax: bool = False  # the verified rows need only their logits' argmax: ids (n, T) int64 may come back

    @property
    def rows(self) -> int:
        return len(self.input_ids)


class Backend(ABC):
    name: str = "abstract"
    # whether ``layer`` takes and gives host (numpy) arrays, so that run_layers may run a layer over
    # a span of a call's rows and put the others back beside it
    narrows_rows: bool = False

    @abstractmethod
    def kv_storage(self) -> KVStorage:
        """A storage for this backend's K/V (the KV cache allocates it)."""

    def limits(self) -> tuple[int | None, int | None]:
        """(most rows, most positions per row) this backend can run; None = no limit of its own."""
        return None, None

    def max_tokens(self) -> int | None:
        """Most new tokens a graph call takes (a prefill chunk); None = no limit of its own. A longer
        prompt is run in chunks of at most this many."""
        return None

    def check_limits(self, rows: int, length: int) -> None:
        """Refuse a Generator of ``rows`` KV rows of ``length`` positions past ``limits()``."""
        most_rows, most_length = self.limits()
        for name, value, most in (("max_batch", rows, most_rows), ("max_length", length, most_length)):
            if most is not None and value > most:
                raise InvalidArgumentError(f"{name} {value} exceeds the {self.name} backend's limit "
                                           f"{most}; load with {name}={most}")

    @abstractmethod
    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray):
        """input_ids (B, T) int64, attention_mask (B, W + T) int64 -> hidden states (B, T, D)."""

    @abstractmethod
    def layer(self, index: int, hidden, attention_mask: np.ndarray, past_key, past_value):
        """Layer graph ``index``: hidden (B, T, D), attention_mask (B, W + T) int64, the past the
        KV cache binds (B, nh, hd, W) and (B, nh, W, hd) -> (hidden (B, T, D), new_key, new_value
        (B, nh, T, hd))."""

    @abstractmethod
    def keep(self, update: np.ndarray, out, hidden):
        """update (B,) bool: ``out`` where True, ``hidden`` where False (rows that skip the layer)."""

    @abstractmethod
    def head(self, hidden, rows: np.ndarray | None = None) -> np.ndarray:
        """hidden (B, T, D) -> fp32 logits (len(rows), V) of the last position of ``rows`` (None = all)."""

    def draft_head(self, hidden) -> np.ndarray:
        """``head(hidden)`` for a step of lossless drafts only: a backend with a cheaper head for them
        (the artifact's ``draft_head``) reads that; the verify pass still reads ``head``."""
        return self.head(hidden)

    def head_all(self, hidden, rows: np.ndarray) -> np.ndarray:
        """hidden (B, T, D) -> fp32 logits (len(rows), T, V) of every position of ``rows``: a
        verify pass's (lossless decoding). By default one ``head`` call per position."""
        T = hidden.shape[1]
        return np.stack([self.head(hidden[:, : t + 1], rows) for t in range(T)], axis=1)

    def run_layers(self, cache: KVCache, start: int, count: int, hidden, mask, layers, updates=None,
                   draft: bool = False):
        """Layers ``layers`` over cache rows [start, start + count) (``run_layers``); a backend
        whose graphs write the cache themselves (ONNX Runtime's fused layers) overrides it.
        ``draft``: a step of lossless drafts, which a backend with cheaper layers for them (the
        artifact's ``draft_layers``) runs there; the verify pass runs the layers."""
        return run_layers(self, cache, start, count, hidden, mask, layers, updates)

    def setup_seconds(self) -> float:
        """Seconds spent so far on one-time work inside calls (the torch backend's CUDA graph
        captures): the engine takes what a call spent on it out of what the call costs, since the
        same call will not pay it again."""
        return 0.0

    def decode(self, step: DecodeStep, cache: KVCache) -> np.ndarray:
        """One decode step: fp32 logits (step.rows, V), or with ``step.argmax`` perhaps their argmax
        (step.rows,) int64 (``tokens``)."""
        return run_decode(self, step, cache)

    def verify(self, check: VerifyPass, cache: KVCache) -> np.ndarray:
        """One verify pass, every layer writing the verified rows' K/V at their T new positions:
        fp32 logits (len(check.verified), T, V) of every position, or with ``check.argmax`` perhaps
        their argmax (len(check.verified), T) int64 (``tokens``). The cache's lengths do not move
        (the engine grows the rows by what they keep)."""
        return run_verify(self, check, cache)

    def close(self) -> None:
        """Release sessions and device memory (nothing to do by default)."""
        return None


def tokens(out: np.ndarray) -> np.ndarray:
    """The token ids of an ``argmax`` call's result: the ids a backend picked itself (int64), or
    the argmax of the logits it returned instead (the first of equal maxima, as torch's)."""
    return out if out.dtype.kind in "iu" else out.argmax(axis=-1)


def run_layers(backend: Backend, cache: KVCache, start: int, count: int, hidden, mask, layers,
               updates=None):
    """Layers ``layers`` over the block of cache rows [start, start + count) (hidden's rows), each
    writing its new K/V for the rows it updates (``updates[k]`` (B,) bool, None = all rows).

    A layer that only some rows run (a step's rows at different depths: SkipDecode's budgets of
    rows at other speedups or positions) runs over the span of rows from the first to the last of
    them, on a backend whose layers take and give host arrays (``narrows_rows``): the deepest row's
    extra layers no longer cost every row of the batch (docs/benchmarks.md, "Rows at different
    depths")."""
    for k, index in enumerate(layers):
        update = None if updates is None else updates[k]
        lo, hi = 0, count
        if update is not None and backend.narrows_rows and not update.all():
            on = np.flatnonzero(update)
            if not on.size:  # no row runs it
                continue
            lo, hi = int(on[0]), int(on[-1]) + 1
        narrow = hi - lo < count
        part, rows, rows_mask = (update[lo:hi], hidden[lo:hi], mask[lo:hi]) if narrow else (update, hidden, mask)
        past_key, past_value = cache.past(index, start + lo, start + hi)
        out, new_key, new_value = backend.layer(index, rows, rows_mask, past_key, past_value)
        cache.write(index, new_key, new_value, np.arange(hi - lo) if part is None else np.flatnonzero(part), start + lo)
        if part is not None and not part.all():
            out = backend.keep(part, out, rows)
        # the span's rows replaced, the others as they were
        hidden = np.concatenate([hidden[:lo], out, hidden[hi:]], axis=0) if narrow else out
    return hidden


def run_verify(backend: Backend, check: VerifyPass, cache: KVCache) -> np.ndarray:
    return backend.head_all(verify_hidden(backend, check, cache), check.verified)  # (n, T, V)


def verify_hidden(backend: Backend, check: VerifyPass, cache: KVCache):
    """A verify pass up to its head: embed, every layer (R, T, D)."""
    hidden = backend.embed(check.input_ids, check.attention_mask)  # (R, T, D)
    return backend.run_layers(cache, 0, check.rows, hidden, check.attention_mask, range(check.depth),
                              [check.updates] * check.depth)


def run_decode(backend: Backend, step: DecodeStep, cache: KVCache) -> np.ndarray:
    hidden = decode_hidden(backend, step, cache)  # (R, 1, D)
    return backend.draft_head(hidden) if step.draft else backend.head(hidden)


def decode_hidden(backend: Backend, step: DecodeStep, cache: KVCache):
    """A decode step up to its head: embed, the step's layers (R, 1, D)."""
    hidden = backend.embed(step.input_ids, step.attention_mask)  # (R, 1, D)
    return backend.run_layers(cache, 0, step.rows, hidden, step.attention_mask, step.layers, step.updates,
                              draft=step.draft)
