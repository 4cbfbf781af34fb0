"""trtexec profiling of an artifact's graphs: the exact command, and with --run, a latency table.

``python -m tools.trtexec ARTIFACT_DIR --graph layer_03 --batch 4 --past 256 [--run] [--all] [--polygraphy]``

With --polygraphy, beside each trtexec command the ``polygraphy run --onnxrt --trt`` comparison of the
same graph with ONNX Runtime (polygraphy.py), layer by layer with --layerwise.

No TensorRT is imported here: the version-dependent flags are pure functions of a version that is
given, read from trtexec's banner, or taken from the tensorrt module only when asked for.
"""

from .command import OutputPaths, RunSettings, build_command, format_command, parse_size_mib
from .errors import (PrecisionError, ProfileLimitError, TrtexecError, TrtexecFailedError,
                     TrtexecNotFoundError, TrtexecOutputError, UnknownGraphError)
from .flags import Precision, precision_flags, workspace_flag
from .polygraphy import build_polygraphy_command
from .report import GraphResult, LayerTime, TimeStats, markdown_report, read_profile, read_times, time_stats
from .shapes import Limits, Profile, resolve_profile, shape_spec
from .version import DetectedVersion, TrtVersion, detect_version, parse_banner

__all__ = [
    "DetectedVersion", "GraphResult", "LayerTime", "Limits", "OutputPaths", "Precision", "PrecisionError",
    "Profile", "ProfileLimitError", "RunSettings", "TimeStats", "TrtVersion", "TrtexecError",
    "TrtexecFailedError", "TrtexecNotFoundError", "TrtexecOutputError", "UnknownGraphError", "build_command", "build_polygraphy_command",
    "detect_version", "format_command", "markdown_report", "parse_banner", "parse_size_mib", "precision_flags",
    "read_profile", "read_times", "resolve_profile", "shape_spec", "time_stats", "workspace_flag",
]
