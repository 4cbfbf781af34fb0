"""The exact trtexec command line for one graph.

Flag spellings are trtexec's own (``trtexec --help`` of TensorRT 10.5 and 8.x, NVIDIA/TensorRT
samples/trtexec/README.md): --onnx, --minShapes/--optShapes/--maxShapes, --shapes, --saveEngine,
--timingCacheFile, --memPoolSize, --warmUp (ms), --duration (s), --iterations, --noDataTransfers,
--useCudaGraph, --separateProfileRun, --exportTimes, --exportProfile.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from runtime.artifact.manifest import GraphSpec

from .errors import TrtexecError
from .flags import Precision, workspace_flag
from .shapes import Profile, shape_spec
from .version import TrtVersion

TIMING_CACHE_NAME = "timing.cache"  # one cache for every graph: the decoder layers share their shapes


@dataclass(frozen=True)
class RunSettings:
    warmup_ms: int = 500  # trtexec's default is 200; a Jetson's clocks need longer to settle
    duration_s: int = 5  # trtexec's default is 3
    iterations: int = 100  # at least this many timed queries, so p99 is not simply the slowest one
    workspace_mib: int = 2048  # builder workspace; trtexec's default is all device memory, too much on 8 GB
    cuda_graph: bool = False  # --useCudaGraph, as the runtime's optional CUDA graphs would run
    data_transfers: bool | None = None  # None: time H2D/D2H copies only where deployment has them (embed, head)


@dataclass(frozen=True)
class OutputPaths:
    out_dir: Path  # exported times/profile JSON, logs and the shared timing cache
    engine_dir: Path | None = None  # --saveEngine target directory; None: the engine is not saved

    def times(self, graph: str) -> Path:
        return self.out_dir / f"{graph}.times.json"

    def profile(self, graph: str) -> Path:
        return self.out_dir / f"{graph}.profile.json"

    def log(self, graph: str) -> Path:
        return self.out_dir / f"{graph}.log"

    @property
    def timing_cache(self) -> Path:
        return self.out_dir / TIMING_CACHE_NAME

    def engine(self, graph: str) -> Path | None:
        return self.engine_dir / f"{graph}.plan" if self.engine_dir is not None else None


def times_data_transfers(graph: str, setting: bool | None) -> bool:
    """A decoder layer's hidden states and KV cache stay on the device between layers (TensorRT
    backend), so copying them per query would time something deployment never does; the embedding
    takes token ids from the host and the head returns logits to it, so those copies are real."""
    if setting is not None:
        return setting
    return graph in ("embed", "head")


def build_command(trtexec: str, artifact_dir: Path, graph: GraphSpec, profile: Profile, version: TrtVersion,
                  precision: Precision, paths: OutputPaths, settings: RunSettings = RunSettings()) -> list[str]:
    cmd = [trtexec, f"--onnx={Path(artifact_dir) / graph.file}",
           f"--minShapes={shape_spec(graph, profile.min)}",
           f"--optShapes={shape_spec(graph, profile.opt)}",
           f"--maxShapes={shape_spec(graph, profile.max)}",
           f"--shapes={shape_spec(graph, profile.run)}",
           *precision.flags,
           workspace_flag(version, settings.workspace_mib),
           f"--timingCacheFile={paths.timing_cache}"]
    engine = paths.engine(graph.name)
    if engine is not None:
        cmd.append(f"--saveEngine={engine}")
    cmd += [f"--warmUp={settings.warmup_ms}", f"--duration={settings.duration_s}",
            f"--iterations={settings.iterations}"]
    if not times_data_transfers(graph.name, settings.data_transfers):
        cmd.append("--noDataTransfers")
    if settings.cuda_graph:
        cmd.append("--useCudaGraph")
    # The profiler slows every layer down; a separate run keeps it out of the timed queries.
    cmd += ["--separateProfileRun", f"--exportTimes={paths.times(graph.name)}",
            f"--exportProfile={paths.profile(graph.name)}"]
    return cmd


def format_command(cmd: list[str]) -> str:
    """One shell line, quoted where needed, to copy and paste."""
    return shlex.join(cmd)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|kib|kb|m|mib|mb|g|gib|gb)?\s*$", re.IGNORECASE)
_MIB_PER_UNIT = {"b": 1 / 2**20, "k": 1 / 1024, "m": 1, "g": 1024}


def parse_size_mib(text: str) -> int:
    """``"2GiB"``, ``"512M"``, ``"1024"`` (MiB, trtexec's default unit) -> whole MiB, at least 1."""
    m = _SIZE.match(str(text))
    if not m:
        raise TrtexecError(f"workspace size {text!r} is not a size; write e.g. 2GiB, 512MiB or 1024 (MiB)")
    unit = (m.group(2) or "m")[0].lower()
    mib = int(float(m.group(1)) * _MIB_PER_UNIT[unit])
    if mib < 1:
        raise TrtexecError(f"workspace size {text!r} is under 1 MiB; give at least 1MiB (e.g. --workspace 2GiB)")
    return mib
