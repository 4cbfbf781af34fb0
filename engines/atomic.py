"""Atomic file writes: a reader sees the old file or the new one, never a half-written one.

Plans, the engine manifest and the timing cache are written to a temporary sibling, flushed to
disk and renamed over the target (``os.replace`` is atomic on POSIX within one filesystem). An
exception or a kill mid-write leaves the previous file intact and at most a ``.NAME.tmp-PID``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(file)`` on a temporary sibling of ``path``, then rename it over ``path``."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the data (power loss on a Jetson)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path, data) -> None:
    """``data``: bytes or any buffer (TensorRT's IHostMemory), written without a Python copy."""
    write_atomic(path, lambda f: f.write(memoryview(data)))


def write_text_atomic(path, text: str) -> None:
    write_bytes_atomic(path, text.encode())
