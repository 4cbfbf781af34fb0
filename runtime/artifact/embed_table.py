"""The embedding as a row lookup, for artifacts whose embedding graph only gathers rows of one table.

A Llama-family embedding graph is ``Gather(table, input_ids)`` plus zeros (the attention mask's
no-op use that keeps it an input: runtime.models.llama.LlamaEmbed). Export records where that
table lies in the artifact's shared weights file (the manifest's ``embed_table``) and checks this
lookup against the graph, value for value; the ONNX Runtime backend then looks the rows up in the
memory-mapped file instead of running the graph. Why: at batch 1 the graph's run cost 0.13-0.16 ms
of a 3 ms int4 decode step on SmolLM2-135M (its kernels take µs; the rest is a session run on
caches the layers just flushed), the lookup ~0.02 ms; a step gained 0.05-0.08 ms, measured paired
(docs/benchmarks.md, "Fewer operations between runs").
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ..errors import ArtifactError


def entry_problem(entry, files: dict, vocab_size: int, hidden_size: int, dtype: str) -> str | None:
    """What is wrong with a manifest's ``embed_table`` entry ({"file", "offset", "shape"}), or None."""
    if not isinstance(entry, dict) or set(entry) != {"file", "offset", "shape"}:
        return f"embed_table {entry!r} is not an object of file, offset and shape"
    offset, shape = entry["offset"], entry["shape"]
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        return f"embed_table offset {offset!r} is not an int >= 0"
    if shape != [vocab_size, hidden_size]:
        return f"embed_table shape {shape!r} is not [vocab_size, hidden_size] = [{vocab_size}, {hidden_size}]"
    if entry["file"] not in files:
        return f"embed_table file {entry['file']!r} has no sha256 entry"
    end = offset + vocab_size * hidden_size * np.dtype(dtype).itemsize
    if end > files[entry["file"]]["bytes"]:
        return (f"embed_table ends at byte {end} of {entry['file']}, which holds "
                f"{files[entry['file']]['bytes']}")
    return None


class EmbedTable:
    """The rows of the table, read-only, mapped from the artifact's file (``entry``: the manifest's
    ``embed_table``, validated at load)."""

    def __init__(self, directory, entry: dict, dtype: str):
        path = Path(directory) / entry["file"]
        vocab, hidden = entry["shape"]
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.table = np.frombuffer(self._map, dtype=np.dtype(dtype), count=vocab * hidden,
                                       offset=entry["offset"]).reshape(vocab, hidden)  # (V, D)
        except ValueError as exc:  # the file changed after the manifest's checks
            raise ArtifactError(f"{path} holds no {vocab} x {hidden} {dtype} table at byte "
                                f"{entry['offset']} ({exc}); rebuild it with `python -m export build`") from None

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        """input_ids (B, T) int64, each in [0, V) (the runtime checks prompts; sampled ids are) ->
        hidden states (B, T, D), a fresh array."""
        return self.table[input_ids]


__all__ = ["EmbedTable", "entry_problem"]
