"""The embedding as a row lookup, for artifacts whose embedding graph only gathers rows of one table.

A Llama-family embedding graph is ``Gather(table, input_ids)`` plus zeros (the attention mask's
no-op use that keeps it an input: runtime.models.llama.LlamaEmbed). Export records where that
table lies in the artifact's shared weights file (the manifest's ``embed_table``) and checks this
lookup against the graph, value for value; the ONNX Runtime backend then looks the rows up in the
memory-mapped file instead of running the graph. Why: at batch 1 the graph's run cost 0.13-0.16 ms
of a 3 ms int4 decode step on SmolLM2-135M (its kernels take µs; the rest is a session run on
caches the layers just flushed), the lookup ~0.02 ms; a step gained 0.05-0.08 ms, measured paired
(docs/benchmarks.md, "Fewer operations between runs").

An int4/int8 export of a GGUF whose embedding is in 8-bit blocks (Q8_0: the tied head's own bytes)
gathers and dequantizes the blocks instead (export.gguf_blocks.carry_embedding); its entry then
names the levels (``offset``: V x D uint8), their ``block`` and where the float32 ``scales`` (and a
type's ``minimums``) lie, one per block, and the lookup computes d * (q - 128) or d * q + m, as the
graph does.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ..errors import ArtifactError


PLAIN = {"file", "offset", "shape"}
BLOCKS = PLAIN | {"block", "scales"}  # and "minimums" where the type has them


def _offset_problem(name: str, offset) -> str | None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        return f"embed_table {name} {offset!r} is not an int >= 0"
    return None


def entry_problem(entry, files: dict, vocab_size: int, hidden_size: int, dtype: str) -> str | None:
    """What is wrong with a manifest's ``embed_table`` entry ({"file", "offset", "shape"}, and
    "block", "scales", "minimums" for 8-bit blocks), or None."""
    if not isinstance(entry, dict) or set(entry) not in (PLAIN, BLOCKS, BLOCKS | {"minimums"}):
        return (f"embed_table {entry!r} is not an object of file, offset and shape (and block, scales, "
                f"minimums for 8-bit blocks)")
    shape = entry["shape"]
    if shape != [vocab_size, hidden_size]:
        return f"embed_table shape {shape!r} is not [vocab_size, hidden_size] = [{vocab_size}, {hidden_size}]"
    if entry["file"] not in files:
        return f"embed_table file {entry['file']!r} has no sha256 entry"
    block = entry.get("block")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1
                              or hidden_size % block):
        return f"embed_table block {block!r} is not a whole part of hidden_size {hidden_size}"
    parts = ({"offset": np.dtype(dtype).itemsize * vocab_size * hidden_size} if block is None else
             {"offset": vocab_size * hidden_size, "scales": 4 * vocab_size * hidden_size // block,
              **({"minimums": 4 * vocab_size * hidden_size // block} if "minimums" in entry else {})})
    for name, size in parts.items():
        problem = _offset_problem(name, entry[name])
        if problem:
            return problem
        end = entry[name] + size
        if end > files[entry["file"]]["bytes"]:
            what = "" if name == "offset" else f"'s {name}"  # the table itself, or its scales
            return (f"embed_table{what} ends at byte {end} of {entry['file']}, which holds "
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
        self.block = entry.get("block")
        blocks = 1 if self.block is None else hidden // self.block
        try:
            if self.block is None:
                self.table = self._array(entry["offset"], dtype, (vocab, hidden))  # (V, D)
            else:
                self.table = self._array(entry["offset"], np.uint8, (vocab, blocks, self.block))  # (V, nb, block)
                self.scales = self._array(entry["scales"], np.float32, (vocab, blocks))  # (V, nb)
                self.minimums = (self._array(entry["minimums"], np.float32, (vocab, blocks))
                                 if "minimums" in entry else None)
        except ValueError as exc:  # the file changed after the manifest's checks
            raise ArtifactError(f"{path} holds no {vocab} x {hidden} table of {dtype if self.block is None else 'blocks'} "
                                f"at byte {entry['offset']} ({exc}); rebuild it with `python -m export build`") from None

    def _array(self, offset: int, dtype, shape: tuple) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.dtype(dtype), count=int(np.prod(shape)), offset=offset).reshape(shape)

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        """input_ids (B, T) int64, each in [0, V) (the runtime checks prompts; sampled ids are) ->
        hidden states (B, T, D), a fresh array."""
        if self.block is None:
            return self.table[input_ids]
        levels = self.table[input_ids].astype(np.float32)  # (B, T, nb, block)
        d = self.scales[input_ids][..., None]  # (B, T, nb, 1)
        # the graph's arithmetic (export.gguf_blocks.carry_embedding), so the values are its own
        w = d * (levels - np.float32(128)) if self.minimums is None else d * levels + self.minimums[input_ids][..., None]
        return w.reshape(*input_ids.shape, -1)


__all__ = ["EmbedTable", "entry_problem"]
