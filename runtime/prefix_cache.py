"""Prompt reuse: the K/V of prompt prefixes that rows already ran, for new rows that start with them.

A row whose prompt has run at full depth leaves a copy of its K/V for the whole pages of it; a
later row whose prompt starts with the same tokens (whole pages of them, and at least one token
more, whose logits the row needs) takes that prefix's K/V into its own row and runs only the rest:
exact, since a position's K/V depend on nothing after it. Entries are keyed by their tokens at every
page boundary, so a longer entry serves any shorter page-aligned prefix of itself; the least
recently used go first once their bytes pass ``max_bytes``.

Only prompts that run every layer are stored or served (a policy's ``prefill="policy"`` runs step
0's layers, which leaves the other layers' K/V of the prompt unwritten), and only one-row prefills
(a request of one prompt: the server's usual; a batch's rows share their left padding).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def _nbytes(blob) -> int:
    return sum(int(a.nbytes) if hasattr(a, "nbytes") else a.numel() * a.element_size() for kv in blob for a in kv)


@dataclass
class _Entry:
    tokens: bytes  # the prefix's ids, int64 bytes
    blob: object  # KVStorage.read's copy
    nbytes: int


class PrefixCache:
    """Used by the engine's one driving thread only (its worker, or an app's stepper): no lock."""

    def __init__(self, max_bytes: int, page: int):
        if max_bytes <= 0 or page < 1:
            raise ValueError(f"a prefix cache needs max_bytes > 0 and page >= 1, got {max_bytes}, {page}")
        self.max_bytes, self.page = int(max_bytes), page
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._boundaries: dict[bytes, bytes] = {}  # a page-aligned prefix's ids -> the entry holding it
        self.bytes = 0
        self.hits = self.tokens_saved = 0  # counters, for tests and benchmarks

    def __len__(self) -> int:
        return len(self._entries)

    def _prefixes(self, ids: bytes):
        """The page-aligned prefixes of ``ids`` (int64 bytes), as keys: one page, two pages, ..."""
        step = self.page * 8
        return (ids[:n] for n in range(step, len(ids) + 1, step))

    def lookup(self, tokens: np.ndarray):
        """(blob, P) for the longest stored page-aligned prefix of ``tokens`` (R,) that leaves at
        least one token to run, or None."""
        ids = np.ascontiguousarray(tokens, dtype=np.int64)
        for P in range((len(ids) - 1) // self.page * self.page, 0, -self.page):
            key = self._boundaries.get(ids[:P].tobytes())
            if key is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.tokens_saved += P
                return self._entries[key].blob, P
        return None

    def wants(self, tokens: np.ndarray) -> int:
        """How many leading positions of ``tokens`` a store would keep (whole pages): 0 when none,
        or when an entry holds them already."""
        P = len(tokens) // self.page * self.page
        ids = np.ascontiguousarray(tokens[:P], dtype=np.int64).tobytes()
        return 0 if P == 0 or ids in self._entries else P

    def store(self, tokens: np.ndarray, blob) -> None:
        """Keep ``blob``, the K/V of ``tokens`` (whole pages), evicting the least recently used."""
        entry = _Entry(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), blob, _nbytes(blob))
        if entry.nbytes > self.max_bytes:
            return  # one prompt larger than the whole cache: nothing to keep
        while self._entries and self.bytes + entry.nbytes > self.max_bytes:
            self._evict(next(iter(self._entries)))
        self._entries[entry.tokens] = entry
        self.bytes += entry.nbytes
        for prefix in self._prefixes(entry.tokens):
            self._boundaries[prefix] = entry.tokens

    def _evict(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        for prefix in self._prefixes(key):  # its prefixes, unless a later entry holds them now
            if self._boundaries.get(prefix) == key:
                del self._boundaries[prefix]


__all__ = ["PrefixCache"]
