"""The KV cache: which row holds which sequence, how much of it is valid, and the K/V themselves.

Layout (the layer graphs' contract, runtime.models.opt.CachedOPTLayer): per layer one K buffer
(rows, nh, hd, W) and one V buffer (rows, nh, W, hd). A step binds the rows it runs as one block
``[start, stop)`` of the first axis, which is contiguous, so it goes to the graph in place: nothing
is gathered or copied per step, and no empty row is computed or read.

Rows are kept packed: the rows that decode are ``[0, decoding)``, the rows of the one request
whose prompt is being prefilled (perhaps over several chunks) follow at ``[decoding, used)``, and
``[used, max_rows)`` are free. A row that leaves is filled by moving the last row of its group
into its place, once, at departure (plus the last joining row into the gap that opens between
the two groups), so a step over n rows of a cache of M costs what it costs on a cache of n.

``W`` (``width``) is the past a step binds, a whole number of ``page`` positions that covers the
longest row in use: it grows as rows grow and shrinks when the longest one leaves. A storage whose
graph binds a contiguous block (ONNX Runtime, TensorRT) sees its buffers at exactly ``W`` and
re-lays the rows in use in place on a change: a copy of them once per ``page`` steps of the
longest row, where every step reads them anyway. One that can bind strided views (torch) sees the
whole capacity and changes nothing.

``KVCache`` is device-agnostic bookkeeping on the host; a ``KVStorage`` (one per backend kind:
numpy arrays, torch tensors, ONNX Runtime device OrtValues) holds the buffers and does the four
things that touch them: allocate, re-lay at a new width, move a row, write new K/V.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

MASK_VALUE = -65504.0  # the attention score bias of a position the mask excludes: torch.finfo(torch.float16).min,
# finite in fp16 and fp32, so a row with every position masked gets a uniform softmax, not NaN


class KVStorage(ABC):
    """Every layer's K (rows, nh, hd, W) and V (rows, nh, W, hd) on one device."""

    @abstractmethod
    def allocate(self, rows: int, capacity: int, width: int) -> None:
        """Zeroed buffers for ``rows`` rows at ``width`` positions (at most ``capacity``). Zeros, not
        garbage: a masked position still enters probs @ V, and a NaN there would survive the mask."""

    @abstractmethod
    def resize(self, width: int, used: int) -> None:
        """Bind ``width`` positions from now on; rows [0, used) keep their first min(old, new), the
        others hold finite values (masked until written)."""

    @abstractmethod
    def empty(self, rows: int, width: int) -> tuple[Any, Any]:
        """(K, V) of ``rows`` rows holding nothing, ``width`` positions of zeros (read-only)."""

    @abstractmethod
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s K/V of every layer to row ``dst``: at least its positions [0, length)."""

    @abstractmethod
    def past(self, layer: int, start: int, stop: int) -> tuple[Any, Any]:
        """(K, V) of rows [start, stop) at the current width, as the layer graph binds them."""

    @abstractmethod
    def write(self, layer: int, new_key, new_value, src: np.ndarray, dst: np.ndarray,
              positions: np.ndarray) -> None:
        """new_* (B, nh, T, hd), a layer graph's outputs: row ``src[k]``'s T new positions go to
        positions [positions[k], positions[k] + T) of cache row ``dst[k]``."""

    def read(self, row: int, length: int):
        """A copy of row ``row``'s K/V of every layer at positions [0, length), for a prompt's prefix
        to be reused (runtime.prefix_cache); None where this storage cannot, which turns reuse off."""
        return None

    def load(self, row: int, blob, length: int) -> None:
        """Positions [0, length) of row ``row``, every layer, from ``blob`` (``read``'s, perhaps longer)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load K/V into a row")

    def close(self) -> None:
        return None


def pages_width(positions: int, page: int) -> int:
    """``positions`` rounded up to whole pages of ``page``, at least one page."""
    return max(1, -(-int(positions) // page)) * page


def bound_width(past: int, tokens: int, page: int) -> int:
    """The past width a row holding ``past`` positions binds for a step of ``tokens`` new ones, when
    it runs alone (``KVCache.bound``): one page of zeros while it holds nothing, else whole pages
    holding its past and the new positions. For the export's checks, the TensorRT profiles and
    tools.trtexec, which describe the shapes the runtime binds."""
    return page if past == 0 else pages_width(past + tokens, page)


class KVCache:
    """Rows of a KV storage, packed; each row's length and valid positions; the width bound."""

    def __init__(self, storage: KVStorage, max_rows: int, capacity: int, page: int):
        if max_rows < 1 or capacity < 1 or page < 1:
            raise ValueError(f"a KV cache needs max_rows, capacity and page >= 1, got {max_rows}, "
                             f"{capacity}, {page}")
        self.storage, self.max_rows, self.page = storage, max_rows, page
        self.capacity = pages_width(capacity, page)  # the longest row, in whole pages
        self.width = page  # positions bound per row: whole pages, >= the longest row in use
        self.owners: list[Any] = [None] * max_rows  # row -> its sequence (anything with a ``row``)
        self.length = np.zeros(max_rows, dtype=np.int64)  # positions each row holds
        self.valid = np.zeros((max_rows, self.capacity), dtype=np.int64)  # the rows' attention masks
        self.used = self.decoding = 0  # rows [0, decoding) decode, [decoding, used) join
        self.moves = self.resizes = 0  # counters, for tests and benchmarks
        storage.allocate(max_rows, self.capacity, self.width)

    # -- rows ------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        return self.max_rows - self.used

    def seat(self, owners: list) -> range:
        """Seat ``owners`` as the joining rows, after the decoding ones; at most one group joins at once."""
        if self.used != self.decoding:
            raise RuntimeError("a group of rows is already joining: promote() it first")
        if len(owners) > self.free:
            raise ValueError(f"{len(owners)} rows do not fit the {self.free} free rows of the KV cache")
        start = self.used
        for k, owner in enumerate(owners):
            self.owners[start + k] = owner
            owner.row = start + k
        self.used += len(owners)
        return range(start, self.used)

    def promote(self) -> None:
        """The joining rows have their prompt: from now on they decode."""
        self.decoding = self.used

    def release(self, row: int) -> None:
        """Free ``row``; the last row of its group (and the last joining row) fill the gap."""
        if not 0 <= row < self.used:
            raise ValueError(f"row {row} is not in use (rows in use: {self.used})")
        self.owners[row].row = -1
        self.owners[row] = None
        if row < self.decoding:
            self._move(self.decoding - 1, row)
            self._move(self.used - 1, self.decoding - 1)
            self.decoding -= 1
        else:
            self._move(self.used - 1, row)
        self.used -= 1

    def _move(self, src: int, dst: int) -> None:
        """Row src to row dst (its K/V, length, mask and owner); src becomes empty."""
        if src != dst:
            owner = self.owners[src]
            if owner is not None:
                self.storage.move(src, dst, int(self.length[src]))
                self.moves += 1
                owner.row = dst
            self.owners[dst], self.owners[src] = owner, None
            self.length[dst], self.valid[dst] = self.length[src], self.valid[src]
        self.length[src], self.valid[src] = 0, 0

    # -- width -----------------------------------------------------------------------------

    def reserve(self, start: int, stop: int, tokens: int) -> None:
        """Fit the width to the rows in use once rows [start, stop) hold ``tokens`` more positions:
        grown when they would not fit, shrunk when the longest row has left (exact, in pages).

        A joining prompt grows it chunk by chunk, not to its whole length at once: a re-lay
        touches every page of the rows in use at the new width, and fresh pages fault in slowly
        (156 ms for a 512-token join on OPT-125m here, against 2-8 ms a page)."""
        needed = int(self.length[: self.used].max(initial=0))
        if stop > start:
            needed = max(needed, int(self.length[start:stop].max()) + tokens)
        if needed > self.capacity:
            raise ValueError(f"rows would hold {needed} positions, past the KV capacity {self.capacity}")
        width = pages_width(needed, self.page)
        if width != self.width:
            self.storage.resize(width, self.used)
            self.width = width
            self.resizes += 1

    def bound(self, start: int, stop: int) -> int:
        """The past width rows [start, stop) bind: the cache's, or one page of zeros when none of
        them holds anything yet (a prompt's first chunk: its attention then spans the prompt, not
        the prompt twice)."""
        return self.width if self.length[start:stop].any() else self.page

    def past(self, layer: int, start: int, stop: int):
        """(K, V) of rows [start, stop) for layer ``layer``, bound in place."""
        if not self.length[start:stop].any():
            return self.storage.empty(stop - start, self.page)
        return self.storage.past(layer, start, stop)

    def mask(self, start: int, stop: int, new: np.ndarray) -> np.ndarray:
        """(R, bound + T) attention mask of rows [start, stop): their valid past, then ``new`` (R, T)."""
        return np.concatenate([self.valid[start:stop, : self.bound(start, stop)], new], axis=1)

    def write(self, layer: int, new_key, new_value, src: np.ndarray, start: int) -> None:
        """The new K/V of batch rows ``src`` (a block's rows, 0-based) to cache rows start + src, at
        each row's length (advance() moves the lengths on once every layer is written)."""
        if len(src):
            dst = start + src
            self.storage.write(layer, new_key, new_value, src, dst, self.length[dst])

    def advance(self, start: int, stop: int, new: np.ndarray) -> None:
        """Rows [start, stop) now hold the T positions of ``new`` (R, T), the mask of what was written."""
        T = new.shape[1]
        cols = self.length[start:stop, None] + np.arange(T)  # (R, T)
        self.valid[np.arange(start, stop)[:, None], cols] = new
        self.length[start:stop] += T

    def rewind(self, row: int, length: int) -> None:
        """Row ``row`` keeps its first ``length`` positions, those after are dropped (lossless
        decoding: a draft's positions before the verify pass writes them again, then the rejected
        ones); their K/V stay in memory, masked, until positions are written there again."""
        self.valid[row, length: self.length[row]] = 0
        self.length[row] = min(self.length[row], length)

    def grow(self, row: int, count: int) -> None:
        """Row ``row`` now holds ``count`` more valid positions (written by a call over its block)."""
        self.valid[row, self.length[row]: self.length[row] + count] = 1
        self.length[row] += count

    def snapshot(self, row: int, length: int):
        """Row ``row``'s first ``length`` positions of K/V, copied (None: the storage cannot)."""
        return self.storage.read(row, length)

    def restore(self, row: int, blob, length: int) -> None:
        """Row ``row`` (seated, holding nothing) now holds ``length`` valid positions from ``blob``."""
        self.reserve(row, row + 1, length)
        self.storage.load(row, blob, length)
        self.valid[row, :length] = 1
        self.length[row] = length

    def close(self) -> None:
        self.storage.close()


ROW_SLICES = 4  # ArrayStorage.write: up to this many host rows are written a row at a time


def _copy(array):
    """A copy of a numpy array or a torch tensor."""
    return array.clone() if hasattr(array, "clone") else array.copy()


class ArrayStorage(KVStorage):
    """K/V in numpy arrays or torch tensors (the same indexing serves both).

    Each layer's K and V live in one flat buffer of ``rows x capacity`` positions, allocated once
    (numpy's zeros are mapped lazily: only what rows write becomes resident), seen as (rows, nh,
    hd, W) and (rows, nh, W, hd). ``fixed=False`` (ONNX Runtime on the host, TensorRT): the view is
    exactly W wide, so a block of rows is contiguous, and a new width re-lays the rows in use in
    place (a copy of them, nothing allocated). ``fixed=True`` (the torch backend): the view is the
    whole capacity, bound as strided views of W; addresses and strides never change (CUDA graphs
    keep them). ``transposed_keys=False`` (the fused layer graphs, export.fused): K is stored as V
    is, (rows, nh, W, hd), as GroupQueryAttention reads and writes it.
    """

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, zeros, fixed: bool = False,
                 index=None, scope=contextlib.nullcontext, transposed_keys: bool = True):
        self.num_layers, self.nh, self.hd = num_layers, num_heads, head_dim
        self.transposed_keys = transposed_keys  # K (rows, nh, hd, W); False: (rows, nh, W, hd)
        self.zeros = zeros  # shape -> zeroed buffer of the cache's dtype on its device
        self.index = index or (lambda a: a)  # host int64 array -> an index the buffers accept
        self.fixed = fixed
        self.scope = scope  # () -> context every buffer operation runs in (TensorRT: its CUDA stream)
        self.flat: list = []  # per layer (K, V), each (rows * nh * hd * capacity,)
        self.zeros_flat = None  # (rows * nh * hd * page,): the past of rows that hold nothing
        self.keys: list = []  # per layer (rows, nh, hd, W | capacity): views of ``flat``
        self.values: list = []  # per layer (rows, nh, W | capacity, hd)
        self.rows = self.capacity = self.width = 0

    def allocate(self, rows, capacity, width):
        self.flat, self.keys, self.values = [], [], []  # the old buffers go before the new ones are made
        size = rows * self.nh * self.hd * capacity
        with self.scope():
            self.flat = [(self.zeros((size,)), self.zeros((size,))) for _ in range(self.num_layers)]
        self.zeros_flat = None
        self.rows, self.capacity = rows, capacity
        self._view(capacity if self.fixed else width)
        self.width = width

    def _view(self, width: int) -> None:
        n = self.rows * self.nh * self.hd * width
        self.keys = [k[:n].reshape(self._key_shape(self.rows, width)) for k, _ in self.flat]
        self.values = [v[:n].reshape(self.rows, self.nh, width, self.hd) for _, v in self.flat]

    def _key_shape(self, rows: int, width: int) -> tuple[int, int, int, int]:
        return (rows, self.nh, self.hd, width) if self.transposed_keys else (rows, self.nh, width, self.hd)

    def _key_positions(self, keys, stop: int):
        """``keys``' positions [0, stop), whichever its layout."""
        return keys[..., :stop] if self.transposed_keys else keys[:, :, :stop]

    def resize(self, width, used):
        if not self.fixed and self.flat and isinstance(self.flat[0][0], np.ndarray):
            self._relay(width, used)
        elif not self.fixed:
            keep = min(width, self.width)
            old_keys, old_values = self.keys, self.values
            self._view(width)
            with self.scope():
                for layer in range(self.num_layers):
                    # The old and new views overlap: copy the rows in use out first, then back.
                    # The new positions keep what the memory held (zeros, or K/V written before:
                    # finite, and masked); zeroing them would touch every fresh page at once.
                    k = _copy(self._key_positions(old_keys[layer][:used], keep))
                    v = _copy(old_values[layer][:used, :, :keep])
                    self._key_positions(self.keys[layer][:used], keep)[...] = k
                    self.values[layer][:used, :, :keep] = v
        self.width = width

    def _relay(self, width: int, used: int) -> None:
        """Host buffers: rows [0, used) re-laid at ``width`` inside their own buffer, a row at a
        time, without copying them out first. A row only moves towards the end when the width grows
        (towards the start when it shrinks), so going from the last row down (the first row up)
        never overwrites a row still to move; numpy's assignment handles a row's overlap with its
        own new place. The copy-out it replaces allocated every layer's rows afresh at each width
        change: fresh pages, which fault in slowly (docs/benchmarks.md, "The KV cache's re-lay")."""
        keep = min(width, self.width)
        rows = range(used - 1, -1, -1) if width > self.width else range(used)
        for buffers in self.flat:
            for flat, transposed in zip(buffers, (self.transposed_keys, False)):
                for r in rows:
                    new, old = self._row(flat, r, width, transposed), self._row(flat, r, self.width, transposed)
                    new[:, :keep] = old[:, :keep]
        self._view(width)

    def _row(self, flat, row: int, width: int, transposed: bool):
        """Row ``row`` of a flat buffer seen at ``width``, positions on axis 1: (nh * hd, W) for a
        transposed K, else (nh, W, hd)."""
        size = self.nh * self.hd * width
        block = flat[row * size:(row + 1) * size]
        return block.reshape(self.nh * self.hd, width) if transposed else block.reshape(self.nh, width, self.hd)

    def empty(self, rows, width):
        n = rows * self.nh * self.hd * width
        if self.zeros_flat is None or len(self.zeros_flat) < n:
            with self.scope():
                self.zeros_flat = self.zeros((self.rows * self.nh * self.hd * width,))
        zeros = self.zeros_flat[:n]
        return zeros.reshape(self._key_shape(rows, width)), zeros.reshape(rows, self.nh, width, self.hd)

    def move(self, src, dst, length):
        # the valid positions only: a fixed storage's row is the whole capacity (the torch backend's
        # max_length), of which a row may hold a few
        with self.scope():
            for keys, values in zip(self.keys, self.values):
                self._key_positions(keys[dst:dst + 1], length)[...] = self._key_positions(keys[src:src + 1], length)
                values[dst, :, :length] = values[src, :, :length]

    def past(self, layer, start, stop):
        if self.fixed:
            return (self._key_positions(self.keys[layer][start:stop], self.width),
                    self.values[layer][start:stop, :, : self.width])
        return self.keys[layer][start:stop], self.values[layer][start:stop]

    def write(self, layer, new_key, new_value, src, dst, positions):
        T = new_key.shape[2]
        if len(src) <= ROW_SLICES and isinstance(new_key, np.ndarray):
            # A few host rows: a basic slice per row, 2.3 µs a layer at one row against 8.2 for the
            # one fancy-indexed write below (level at 8 rows); a decode step writes every layer.
            keys, values = self.keys[layer], self.values[layer]
            for s, d, p in zip(src.tolist(), dst.tolist(), positions.tolist()):
                if self.transposed_keys:
                    keys[d, :, :, p:p + T] = new_key[s].swapaxes(1, 2)  # (nh, hd, T) <- (nh, T, hd)
                else:
                    keys[d, :, p:p + T] = new_key[s]  # (nh, T, hd)
                values[d, :, p:p + T] = new_value[s]  # (nh, T, hd)
            return
        with self.scope():
            at = self.index(dst[:, None])  # (R, 1)
            where = self.index(positions[:, None] + np.arange(T))  # (R, T)
            picked = self.index(src)
            # Advanced indices on dims 0 and 3 (K) or 2 (V) around slices put the index dims
            # first: both targets are (R, T, nh, hd), as is the source once its nh and T dims swap.
            if self.transposed_keys:
                self.keys[layer][at, :, :, where] = new_key[picked].swapaxes(1, 2)
            else:
                self.keys[layer][at, :, where] = new_key[picked].swapaxes(1, 2)
            self.values[layer][at, :, where] = new_value[picked].swapaxes(1, 2)

    def read(self, row, length):
        with self.scope():
            return [(_copy(self._key_positions(k[row:row + 1], length)), _copy(v[row:row + 1, :, :length]))
                    for k, v in zip(self.keys, self.values)]  # per layer (1, nh, hd | length, length | hd)

    def load(self, row, blob, length):
        with self.scope():
            for (k, v), keys, values in zip(blob, self.keys, self.values):
                self._key_positions(keys[row:row + 1], length)[...] = self._key_positions(k, length)
                values[row:row + 1, :, :length] = v[:, :, :length]

    def close(self):
        self.flat, self.keys, self.values, self.zeros_flat = [], [], [], None


__all__ = ["ArrayStorage", "KVCache", "KVStorage", "bound_width", "pages_width"]
