"""The exact ``polygraphy run`` that compares a TensorRT build of one graph with ONNX Runtime.

Printed beside the trtexec command (``python -m tools.trtexec DIR --graph layer_03 --polygraphy``):
the same graph, the same optimization profile and run shapes, the precision the engines use, and
tolerances per precision. ``--layerwise`` marks every tensor as an output in both runners, so the
first tensor whose values part shows which TensorRT layer went wrong.

Flag spellings are Polygraphy's own (tools/Polygraphy/polygraphy/tools/args in NVIDIA/TensorRT):
--onnxrt / --trt (runner selection); --input-shapes (ModelArgs); --trt-min-shapes /
--trt-opt-shapes / --trt-max-shapes, ``name:[d0,d1,...]`` per input, one group per profile, and
--tf32 / --fp16 / --pool-limit workspace:SIZE with a K/M/G suffix (TrtConfigArgs); --strongly-typed
and --trt-outputs mark all (TrtLoadNetworkArgs); --onnx-outputs mark all (OnnxLoadArgs); --val-range
``name:[min,max]``, both ends inclusive for integers (DataLoaderArgs, DataLoader); --atol / --rtol
(CompareFuncSimpleArgs).
"""

from __future__ import annotations

from pathlib import Path

from engines.verify import TOLERANCE as ENGINE_TOLERANCE, value_ranges as engine_value_ranges
from runtime.artifact.manifest import GraphSpec

from .flags import Precision
from .shapes import Profile, input_dims

# (atol, rtol): `python -m engines verify`'s, for the same comparison run by hand (see engines.verify).
TOLERANCE = ENGINE_TOLERANCE


def polygraphy_shape_spec(graph: GraphSpec, point: dict) -> list[str]:
    """Polygraphy's shape arguments, ``name:[d0,d1,...]``, one per input in the graph's order."""
    return [f"{name}:[" + ",".join(map(str, dims)) + "]" for name, dims in input_dims(graph, point)]


def precision_flags(precision: Precision, onnx_dtype: str) -> list[str]:
    """Polygraphy's build flags for what the trtexec command (and the engines) build.

    trtexec enables TF32 for fp32 unless told --noTF32, and so does the TensorRT builder the engines
    use; Polygraphy leaves it off unless --tf32, so it is passed to check the engine that runs.
    """
    flags = set(precision.flags)
    if "--stronglyTyped" in flags or (onnx_dtype == "float16" and not flags):
        return ["--strongly-typed"]  # TensorRT 11: no flag for trtexec, always strongly typed
    if "--fp16" in flags:
        return ["--fp16"]
    return ["--tf32"]


def value_ranges(graph: GraphSpec, vocab_size: int) -> list[str]:
    """Inputs a random loader would make invalid: ids inside the vocabulary, an all-ones mask (every
    position real, so no row is fully masked), as engines verify feeds them. Float inputs keep
    Polygraphy's default [0, 1]."""
    return [f"{name}:[{lo},{hi}]" for name, (lo, hi) in engine_value_ranges(graph, vocab_size).items()]


def build_polygraphy_command(artifact_dir: Path, graph: GraphSpec, profile: Profile, precision: Precision,
                             onnx_dtype: str, vocab_size: int, workspace_mib: int,
                             layerwise: bool = False) -> list[str]:
    atol, rtol = TOLERANCE
    ranges = value_ranges(graph, vocab_size)
    cmd = ["polygraphy", "run", str(Path(artifact_dir) / graph.file), "--onnxrt", "--trt",
           "--trt-min-shapes", *polygraphy_shape_spec(graph, profile.min),
           "--trt-opt-shapes", *polygraphy_shape_spec(graph, profile.opt),
           "--trt-max-shapes", *polygraphy_shape_spec(graph, profile.max),
           "--input-shapes", *polygraphy_shape_spec(graph, profile.run),
           *precision_flags(precision, onnx_dtype), "--pool-limit", f"workspace:{workspace_mib}M"]
    if ranges:
        cmd += ["--val-range", *ranges]
    if layerwise:
        cmd += ["--onnx-outputs", "mark", "all", "--trt-outputs", "mark", "all"]
    return cmd + ["--atol", f"{atol:g}", "--rtol", f"{rtol:g}"]


def tolerance_note(precision: Precision, onnx_dtype: str) -> str:
    return (f"polygraphy: {' '.join(precision_flags(precision, onnx_dtype))}, atol {TOLERANCE[0]:g} rtol "
            f"{TOLERANCE[1]:g}: an element fails when off by more than both; fp16 and TF32 matmuls keep 10 "
            f"mantissa bits, and the export's fp16 graphs pass this against PyTorch")
