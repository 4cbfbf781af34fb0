"""Paths named in a manifest stay inside their directory.

manifest.json and engines.json name files relative to the artifact (or engine) directory. A path
that is absolute, climbs out with ``..``, or goes through a symbolic link that leaves the
directory would make ``runtime.load`` read, hash and open files elsewhere (``../../etc/passwd``),
so it is refused with the file that named it.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from ..errors import ArtifactError


def confined(directory, rel, named_in, hint: str) -> Path:
    """``directory / rel``, after checking that it stays inside ``directory`` (links resolved).

    named_in: the file that named ``rel`` (for the message); hint: how to fix it.
    """
    if not isinstance(rel, str) or not rel:
        raise ArtifactError(f"{named_in} names a file path {rel!r} that is not a non-empty string; {hint}")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or PureWindowsPath(rel).is_absolute() or PureWindowsPath(rel).drive \
            or ".." in pure.parts or "\\" in rel:
        raise ArtifactError(
            f"{named_in} names {rel!r}, a path outside its directory {directory}: every path in it "
            f"must be relative and stay inside (no absolute paths, no '..'); {hint}")
    root = Path(directory).resolve()
    path = Path(directory) / rel
    target = path.resolve()
    if target != root and root not in target.parents:
        raise ArtifactError(
            f"{named_in} names {rel!r}, which is a link that leads outside {directory} (to "
            f"{target}); an artifact must hold its own files, not links out of it; {hint}")
    return path
