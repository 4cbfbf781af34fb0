"""Which TensorRT the trtexec flags are for: --trt-version, trtexec's banner, the Python module, or a default.

trtexec's own banner wins over ``import tensorrt``: the flags are read by the trtexec binary, and a
pip-installed ``tensorrt`` in a venv can differ from the system trtexec (e.g. JetPack's). Everything is
probed lazily: nothing is imported or run unless no version was given.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from .errors import TrtexecError

# JetPack 6.1/6.2 ship TensorRT 10.3, the target for JetPack 6; used when nothing says otherwise.
DEFAULT_VERSION_TEXT = "10.3"
PROBE_TIMEOUT_S = 60  # `trtexec --help` loads libnvinfer; slow on a Jetson's eMMC, never minutes

# Every trtexec run starts with "&&&& RUNNING TensorRT.trtexec [TensorRT v100500] [b18] # trtexec ...".
# The number is NV_TENSORRT_VERSION: major*1000 + minor*100 + patch up to 9.x ("v8601" = 8.6.1),
# major*10000 + minor*100 + patch from 10.0 ("v100500" = 10.5.0).
_BANNER = re.compile(r"TensorRT\.trtexec \[TensorRT v(\d+)\]")


@dataclass(frozen=True, order=True)
class TrtVersion:
    major: int
    minor: int = 0  # "10" alone means 10.0
    patch: int = 0  # "10.3" means 10.3.0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @classmethod
    def parse(cls, text: str) -> TrtVersion:
        """``"10.3"``, ``"8.6.1"``, ``"10.3.0.26"`` (build number ignored)."""
        parts = str(text).strip().lstrip("v").split(".")
        try:
            numbers = [int(p) for p in parts[:3]]
        except ValueError:
            numbers = []
        if not numbers or numbers[0] < 1:
            raise TrtexecError(
                f"TensorRT version {text!r} is not MAJOR.MINOR[.PATCH]; pass e.g. --trt-version 10.3")
        return cls(*numbers)

    @classmethod
    def from_banner_number(cls, number: int) -> TrtVersion:
        if number >= 100000:  # 10.0 and later: two digits for the minor version
            return cls(number // 10000, number // 100 % 100, number % 100)
        return cls(number // 1000, number // 100 % 10, number % 100)


@dataclass(frozen=True)
class DetectedVersion:
    version: TrtVersion
    source: str  # where it came from, printed so an assumption is never silent
    assumed: bool = False  # True when nothing was found and DEFAULT_VERSION_TEXT is used


def parse_banner(output: str) -> TrtVersion | None:
    m = _BANNER.search(output)
    return TrtVersion.from_banner_number(int(m.group(1))) if m else None


def probe_trtexec(path: str) -> TrtVersion | None:
    """The version in the banner of ``trtexec --help`` (printed whatever the exit status)."""
    try:
        done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_banner(done.stdout + done.stderr)


def python_tensorrt_version() -> TrtVersion | None:
    """``tensorrt.__version__``, imported only here. The PyPI stub wheels fail on import, hence the
    broad except."""
    try:
        import tensorrt
        return TrtVersion.parse(tensorrt.__version__)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return None


def detect_version(explicit: str | None, trtexec_path: str | None) -> DetectedVersion:
    if explicit:
        return DetectedVersion(TrtVersion.parse(explicit), "--trt-version")
    if trtexec_path:
        found = probe_trtexec(trtexec_path)
        if found:
            return DetectedVersion(found, f"banner of {trtexec_path}")
    found = python_tensorrt_version()
    if found:
        return DetectedVersion(found, "the tensorrt Python module")
    return DetectedVersion(
        TrtVersion.parse(DEFAULT_VERSION_TEXT),
        f"assumed: no trtexec and no tensorrt module found, so TensorRT {DEFAULT_VERSION_TEXT} "
        f"(JetPack 6) is assumed; pass --trt-version for another", assumed=True)
