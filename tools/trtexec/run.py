"""Find trtexec and run it, one graph at a time, with its output in a log beside the JSON it exports."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .errors import TrtexecFailedError, TrtexecNotFoundError

# Where TensorRT packages put trtexec outside PATH: JetPack (Jetson) and NVIDIA's Debian packages.
KNOWN_LOCATIONS = ("/usr/src/tensorrt/bin/trtexec",)
LOG_TAIL_LINES = 20  # lines of a failed run's log quoted in the error


def find_trtexec(explicit: str | None = None) -> str | None:
    """--trtexec, else ``trtexec`` on PATH, else a known install location; None when there is none."""
    if explicit:  # a bare name is looked up on PATH, a path is taken as it is
        return shutil.which(explicit) or explicit
    on_path = shutil.which("trtexec")
    if on_path:
        return on_path
    for candidate in KNOWN_LOCATIONS:
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def require_trtexec(explicit: str | None = None) -> str:
    path = find_trtexec(explicit)
    if path is None:
        raise TrtexecNotFoundError(
            "--run needs NVIDIA's trtexec, which is not on PATH (nor at "
            f"{', '.join(KNOWN_LOCATIONS)}). It comes with TensorRT: on a Jetson (JetPack) it is "
            "/usr/src/tensorrt/bin/trtexec; with NVIDIA's tar/deb packages it is in TensorRT's bin/ "
            "directory; in NVIDIA's TensorRT containers it is on PATH. Add that directory to PATH or pass "
            "--trtexec /path/to/trtexec; without --run this tool only prints the command")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise TrtexecNotFoundError(
            f"--trtexec {path} is not an executable file; pass the path of the trtexec binary")
    return path


def run_trtexec(cmd: list[str], log_path: Path) -> None:
    """Run ``cmd``, stdout and stderr into ``log_path``; a non-zero exit raises with the log's tail."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        except OSError as exc:
            raise TrtexecNotFoundError(f"could not start {cmd[0]} ({exc}); pass a working --trtexec") from exc
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        raise TrtexecFailedError(
            f"trtexec exited with status {code}; last lines of {log_path}:\n{tail}\n"
            f"rerun the printed command by hand to investigate")
