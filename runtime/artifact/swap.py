"""Replace a directory (an artifact, a checkpoint) so that a kill at any moment loses nothing.

A build writes its result into a hidden sibling ``.NAME.tmp-PID`` and then swaps it into place:

* where the kernel and filesystem have it, one ``renameat2(RENAME_EXCHANGE)`` swaps the two
  directories atomically: ``NAME`` is always the old or the new directory, never absent. The old
  one ends up at ``.NAME.tmp-PID`` and is removed;
* otherwise two renames: ``NAME -> .NAME.old-PID``, then ``.NAME.tmp-PID -> NAME``. A kill between
  them leaves no ``NAME``; ``recover`` (run by the next build and by ``runtime.load``) renames
  the complete one back into place.

``remove_leftovers`` deletes the ``.NAME.tmp-PID`` / ``.NAME.old-PID`` of processes that are gone
(each can be gigabytes). A directory counts as complete when it holds ``marker`` (the manifest,
written last).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

AT_FDCWD = -100
RENAME_EXCHANGE = 2  # linux/fs.h
# renameat2 exists but this filesystem or kernel cannot exchange: fall back to two renames
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}


def _hook(step: str) -> None:
    """Called between the steps of a swap; tests replace it to kill the process right there."""


def temp_sibling(path: Path, kind: str = "tmp", pid: int | None = None) -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid() if pid is None else pid}")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2; False where this system cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or glibc < 2.28
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _fsync_dir(directory: Path) -> None:
    """Make the renames durable (a power cut on a Jetson must not undo them)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def swap_into_place(tmp: Path, out: Path) -> None:
    """Replace ``out`` by ``tmp`` so that ``out`` is always either the old or the new directory
    (or, on systems without RENAME_EXCHANGE, recoverable by ``recover``)."""
    tmp, out = Path(tmp), Path(out)
    if not out.exists():
        tmp.rename(out)
    elif _exchange(tmp, out):
        _hook("exchanged")  # out is the new one; tmp holds the old one
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = temp_sibling(out, "old")
        out.rename(old)
        _hook("moved-old")  # no out: recover() puts the complete one back
        tmp.rename(out)
        _hook("moved-new")
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out.parent)


def _siblings(out: Path) -> list[tuple[Path, str, int]]:
    """(path, "tmp"/"old", pid) of the hidden siblings builds of ``out`` leave."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old)-(\d+)$")
    found = []
    if out.parent.is_dir():
        for p in out.parent.iterdir():
            m = pattern.match(p.name)
            if m:
                found.append((p, m.group(1), int(m.group(2))))
    return found


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers are from an earlier build in this process, or from ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def recover(out: Path, marker: str) -> Path | None:
    """Put a complete directory back at ``out`` when a swap was killed between its two renames.

    Prefers the new one (``.tmp``, complete once it holds ``marker``: the build had finished)
    over the old one. Returns what was restored, or None.
    """
    out = Path(out)
    if out.exists():
        return None
    dead = [(p, kind, pid) for p, kind, pid in _siblings(out) if not _alive(pid)]
    for wanted in ("tmp", "old"):
        for p, kind, _ in dead:
            if kind == wanted and (p / marker).is_file():
                p.rename(out)
                return out
    return None


def remove_leftovers(out: Path) -> list[Path]:
    """Delete the ``.NAME.tmp-PID`` / ``.NAME.old-PID`` siblings whose process is gone."""
    removed = []
    for p, _, pid in _siblings(Path(out)):
        if not _alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
