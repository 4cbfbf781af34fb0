"""The embedding as a row lookup, for artifacts whose embedding graph only gathers rows of one table.

A Llama-family embedding graph is ``Gather(table, input_ids)`` plus zeros (the attention mask's
no-op use that keeps it an input: runtime.models.llama.LlamaEmbed). Export records where that
table lies in the artifact's shared weights file (the manifest's ``embed_table``) and checks this
lookup against the graph, value for value; the ONNX Runtime backend then looks the rows up in the
file (pread, row by row) instead of running the graph. Why: at batch 1 the graph's run cost 0.13-0.16 ms
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

import os
from pathlib import Path

import numpy as np

from ..errors import ArtifactError


PLAIN = {"file", "offset", "shape"}
BLOCKS = PLAIN | {"block", "scales"}  # and "minimums" where the type has them


def layout(entry: dict, dtype: str) -> dict[str, tuple]:
    """Where each part of an entry's table lies, by the entry's field that places it: {field:
    (byte offset, dtype, values a row)}: "offset" the table (V, D) of ``dtype``, or for 8-bit blocks
    its levels (V, D) uint8, with "scales" (and "minimums") (V, D / block) float32."""
    hidden, block = entry["shape"][1], entry.get("block")
    if block is None:
        return {"offset": (entry["offset"], np.dtype(dtype), hidden)}
    per_block = (np.dtype(np.float32), hidden // block)
    return {"offset": (entry["offset"], np.dtype(np.uint8), hidden), "scales": (entry["scales"], *per_block),
            **({"minimums": (entry["minimums"], *per_block)} if "minimums" in entry else {})}


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
    for name, (offset, dt, width) in layout(entry, dtype).items():
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            return f"embed_table {name} {offset!r} is not an int >= 0"
        end = offset + vocab_size * width * dt.itemsize
        if end > files[entry["file"]]["bytes"]:
            what = "" if name == "offset" else f"'s {name}"  # the table itself, or its scales
            return (f"embed_table{what} ends at byte {end} of {entry['file']}, which holds "
                    f"{files[entry['file']]['bytes']}")
    return None


class EmbedTable:
    """The rows of the table, read from the artifact's file as they are asked for (``entry``: the
    manifest's ``embed_table``, validated at load).

    Rows are read with pread, not through a mapping: a mapped file's page faults map whole page-cache
    folios (up to 2 MiB on Linux 6.x), so looking up 150 of SmolLM2's 49,152 rows of a freshly written
    8-bit table made 27 MiB of it resident in the process; read, the rows cost their bytes and the
    file stays in the page cache, shared and reclaimable. A row costs ~7 us (float) or ~15 us (8-bit
    blocks, dequantized) a token, against ~3.5 us through a mapping: a few thousandths of a step."""

    def __init__(self, directory, entry: dict, dtype: str):
        self.path = Path(directory) / entry["file"]
        vocab, hidden = entry["shape"]
        self.block = entry.get("block")
        self.hidden = hidden
        self._file = open(self.path, "rb")
        size = self._file.seek(0, 2)
        self._parts = layout(entry, dtype)  # "offset": the table or its levels; "scales", "minimums"
        for offset, dt, width in self._parts.values():
            if offset + vocab * width * dt.itemsize > size:  # the file changed after the manifest's checks
                self.close()
                raise ArtifactError(f"{self.path} holds no {vocab} x {width} {dt} values at byte {offset} "
                                    f"(it has {size} bytes); rebuild it with `python -m export build`")

    def _rows(self, name: str, ids: list[int]) -> np.ndarray:
        """(n, width) rows ``ids`` of part ``name``, read from the file."""
        offset, dt, width = self._parts[name]
        size = width * dt.itemsize
        fd = self._file.fileno()
        data = bytearray(b"".join([os.pread(fd, size, offset + i * size) for i in ids]))  # writable, as a gather's
        return np.frombuffer(data, dtype=dt).reshape(-1, width)

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        """input_ids (B, T) int64, each in [0, V) (the runtime checks prompts; sampled ids are) ->
        hidden states (B, T, D), a fresh array."""
        ids = input_ids.ravel().tolist()
        if self.block is None:
            return self._rows("offset", ids).reshape(*input_ids.shape, self.hidden)  # (B, T, D)
        levels = self._rows("offset", ids).reshape(len(ids), -1, self.block).astype(np.float32)  # (n, nb, block)
        d = self._rows("scales", ids)[..., None]  # (n, nb, 1)
        # the graph's arithmetic (export.gguf_blocks.carry_embedding), so the values are its own
        w = (d * (levels - np.float32(128)) if "minimums" not in self._parts
             else d * levels + self._rows("minimums", ids)[..., None])
        return w.reshape(*input_ids.shape, self.hidden)

    def close(self) -> None:
        self._file.close()


__all__ = ["EmbedTable", "entry_problem", "layout"]
