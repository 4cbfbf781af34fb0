"""File integrity of an artifact: a full sha256 once, a cheap fingerprint at every load.

Hashing OPT-1.3B's 5.7 GB took 44 s at every ``runtime.load``. Instead, each file's sha256 is
computed once (at export, by ``python -m export verify``, or at the first load after the file
changed) and recorded with the file's fingerprint (size, mtime in ns, inode, ctime in ns) in
``.verified.json`` beside the manifest. A later load hashes only the files whose fingerprint no
longer matches: any write to a file changes its mtime and ctime, and a replaced file has a new
inode, so corruption after export is still caught. ``check_hashes="full"`` ignores the record and
hashes every file (``export verify`` does), for when mtimes cannot be trusted (a deliberate
tamperer can reset mtime, but not ctime without root).

The record is a cache, never the reference: the expected sha256 always comes from manifest.json,
and an unwritable artifact directory just means every load hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

VERIFIED_NAME = ".verified.json"  # beside manifest.json; not listed in it (written after it)
PROGRESS_BYTES = 256 << 20  # show a progress bar when a load has to hash more than this


def sha256_file(path: Path, chunk: int = 1 << 20, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress.update(len(block))
    return h.hexdigest()


def fingerprint(path: Path) -> list[int]:
    """What changes when a file's bytes do: size, mtime, inode, ctime (ns)."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def read_verified(directory: Path) -> dict:
    """{relative path: {"sha256", "fingerprint"}} recorded by the last full check ({} if none)."""
    try:
        raw = json.loads((Path(directory) / VERIFIED_NAME).read_text())
        return raw if isinstance(raw, dict) else {}
    except (OSError, ValueError):
        return {}


def write_verified(directory: Path, record: dict) -> None:
    """Write the record atomically; a read-only artifact keeps working (it just hashes each load)."""
    path = Path(directory) / VERIFIED_NAME
    tmp = path.with_name(f"{VERIFIED_NAME}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def record_hashes(directory: Path, hashes: dict[str, str]) -> None:
    """Record files just hashed (by the export that wrote them), so the first load is cheap too."""
    directory = Path(directory)
    record = read_verified(directory)
    for rel, digest in hashes.items():
        record[rel] = {"sha256": digest, "fingerprint": fingerprint(directory / rel)}
    write_verified(directory, record)


def stale_files(directory: Path, files: dict[str, dict], full: bool) -> list[str]:
    """The files whose sha256 must be computed: all of them when ``full``, else those whose
    fingerprint or expected hash differ from the record."""
    if full:
        return list(files)
    record = read_verified(directory)
    stale = []
    for rel, entry in files.items():
        seen = record.get(rel) or {}
        if seen.get("sha256") != entry["sha256"] or seen.get("fingerprint") != fingerprint(Path(directory) / rel):
            stale.append(rel)
    return stale


def hash_files(directory: Path, rels: list[str], files: dict[str, dict]) -> dict[str, str]:
    """sha256 of each file, with a progress bar on a terminal when there is much to hash."""
    directory = Path(directory)
    total = sum(files[rel]["bytes"] for rel in rels)
    progress = None
    if total > PROGRESS_BYTES:
        from tqdm.auto import tqdm

        # disable=None: only on a terminal, so logs and pipes stay clean
        progress = tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=None)
    try:
        return {rel: sha256_file(directory / rel, progress=progress) for rel in rels}
    finally:
        if progress is not None:
            progress.close()
