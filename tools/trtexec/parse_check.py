"""Refuse, before any command is printed or run, a graph that the target TensorRT cannot parse.

export.trt_compat checks each graph's operators, opset and types against onnx-tensorrt's documented
support for the detected TensorRT version (or the nearest older one it has data for), reading the
graphs without their weights. Errors (a ``com.microsoft::MatMulNBits``, an INT4 weight on 8.x)
stop the tool with the reason and the fix: trtexec would only fail minutes later with a parser log.
Warnings (an opset past the documented range that the parser still reads, INT64 I/O on 8.x) are
printed and the command goes on.
"""

from __future__ import annotations

from pathlib import Path

from runtime.artifact.manifest import GraphSpec

from .errors import UnparsableGraphError
from .version import TrtVersion


def check_graphs(artifact_dir: Path, graphs: list[GraphSpec], version: TrtVersion) -> list[str]:
    """Warnings to print (``# warning: ...``); raises UnparsableGraphError on any error."""
    from export.trt_compat import check_graph, load_support

    support = load_support()
    vs = support.nearest(version.major, version.minor)
    data = f"TensorRT {vs.version}'s operator list" + (
        "" if (version.major, version.minor) == tuple(map(int, vs.version.split("."))) else
        f", the nearest known to {version.major}.{version.minor}")
    errors, warnings, bad = [], [], []
    for g in graphs:
        findings = check_graph(Path(artifact_dir) / g.file, vs.version, name=g.name, support=support)[vs.version]
        for f in findings:
            line = f"{f.graph}: {f.detail}" + (f"; fix: {f.fix}" if f.fix else "")
            (errors if f.severity == "error" else warnings).append(line)
            if f.severity == "error" and g.name not in bad:
                bad.append(g.name)
    if errors:
        raise UnparsableGraphError(
            f"TensorRT {version.major}.{version.minor}'s ONNX parser cannot import {', '.join(bad)} "
            f"(checked against {data}):\n  " + "\n  ".join(errors))
    return [f"warning (TensorRT {vs.version}): {w}" for w in dict.fromkeys(warnings)]
