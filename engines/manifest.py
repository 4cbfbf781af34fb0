"""engines.json: what was built, with what, for which GPU, from which graphs.

The engine manifest sits in the engine directory (default ARTIFACT_DIR/engines) beside the plans
and the timing cache. It records the TensorRT version, the GPU, the build settings, and for each
graph the sha256 of its source ONNX files (as the artifact manifest lists them), its profiles and
the sha256 of its plan. It is rewritten atomically after every engine, so an interrupted build
keeps what it finished and a rerun resumes (``build_decision``). At load, ``validate`` refuses
engines of another TensorRT version, another GPU or other source graphs, saying how to rebuild.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.artifact.manifest import GraphSpec, Manifest
from runtime.artifact.paths import confined

from .atomic import write_text_atomic
from .device import DeviceInfo
from .errors import EngineMismatchError, rebuild_hint

ENGINE_MANIFEST = "engines.json"
DEFAULT_ENGINE_DIR = "engines"  # relative to the artifact directory
TIMING_CACHE = "timing.cache"
SCHEMA_VERSION = 1
FORMAT = "skipdecode-trt-engines"


def plan_name(graph: str) -> str:
    return f"{graph}.plan"


def source_hashes(artifact: Manifest, spec: GraphSpec) -> dict[str, str]:
    """{relative file: sha256} of a graph's ONNX file and external data, from the artifact manifest."""
    return {rel: artifact.files[rel]["sha256"] for rel in filter(None, (spec.file, spec.data_file))}


def settings_key(settings: dict, tensorrt_version: str, device: DeviceInfo) -> str:
    """A digest of everything that makes a plan: a plan with another key must be rebuilt."""
    # the device's memory total is left out: it moves with JetPack's carve-outs (DeviceInfo.differs)
    blob = json.dumps({"settings": settings, "tensorrt": tensorrt_version,
                       "device": {k: v for k, v in device.to_dict().items() if k != "memory_mib"}},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class EngineEntry:
    graph: str  # "embed", "layer_00", ..., "head"
    plan: str  # plan file, relative to the engine directory
    plan_sha256: str
    plan_bytes: int
    source: dict  # {relative ONNX file: sha256} it was built from
    settings_key: str  # settings_key() of the build that wrote it
    profiles: list  # [Profile.to_dict()] in profile-index order
    build_seconds: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> "EngineEntry":
        return cls(**d)


@dataclass
class EngineManifest:
    tensorrt_version: str  # trt.__version__ of the build; plans load only in this version
    device: DeviceInfo  # the GPU the plans were tuned for
    settings: dict  # EngineBuildConfig limits + the NetworkPlan flags chosen for this version
    settings_key: str  # settings_key(settings, tensorrt_version, device)
    artifact: dict  # {"dtype", "num_layers"} of the artifact the engines were built from
    engines: dict = field(default_factory=dict)  # graph name -> EngineEntry, built so far
    timing_cache: str | None = TIMING_CACHE  # relative to the engine dir, or an absolute path
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT

    def to_dict(self) -> dict:
        d = asdict(self)
        d["device"] = self.device.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineManifest":
        return cls(tensorrt_version=d["tensorrt_version"], device=DeviceInfo.from_dict(d["device"]),
                   settings=d["settings"], settings_key=d["settings_key"], artifact=d["artifact"],
                   engines={k: EngineEntry.from_dict(v) for k, v in d["engines"].items()},
                   timing_cache=d.get("timing_cache"), schema_version=d["schema_version"],
                   format=d.get("format", FORMAT))

    def save(self, engine_dir) -> None:
        write_text_atomic(Path(engine_dir) / ENGINE_MANIFEST, json.dumps(self.to_dict(), indent=2) + "\n")


def read_engine_manifest(engine_dir, artifact_dir="ARTIFACT_DIR") -> EngineManifest:
    """Read ``engine_dir/engines.json``; EngineMismatchError when absent, unreadable or foreign."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_MANIFEST
    if not path.is_file():
        raise EngineMismatchError(
            f"{engine_dir} has no {ENGINE_MANIFEST}: no TensorRT engines were built there; build "
            f"them on this device with `python -m engines build {artifact_dir}`")
    try:
        raw = json.loads(path.read_text())
        if raw.get("schema_version") != SCHEMA_VERSION or raw.get("format") != FORMAT:
            raise EngineMismatchError(
                f"{path} has format {raw.get('format')!r} schema_version {raw.get('schema_version')!r}, "
                f"this toolkit reads {FORMAT!r} schema_version {SCHEMA_VERSION}; {rebuild_hint(artifact_dir)}")
        em = EngineManifest.from_dict(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise EngineMismatchError(f"{path} is unreadable ({exc!r}); {rebuild_hint(artifact_dir)}") from exc
    for entry in em.engines.values():  # plans are opened from here: none may lie outside
        confined(engine_dir, entry.plan, path, rebuild_hint(artifact_dir))
    return em


def build_decision(entry: EngineEntry | None, source: dict, key: str, engine_dir,
                   force: bool = False) -> tuple[bool, str]:
    """(build?, why) for one graph on a rerun: skip only an intact plan of the same source and key."""
    if force:
        return True, "forced (--force)"
    if entry is None:
        return True, "not built yet"
    if entry.source != source:
        return True, "its source graph changed"
    if entry.settings_key != key:
        return True, "the settings, TensorRT version or GPU changed"
    path = Path(engine_dir) / entry.plan
    if not path.is_file():
        return True, "its plan file is missing"
    if path.stat().st_size != entry.plan_bytes:
        return True, "its plan file has the wrong size (truncated or replaced)"
    return False, "up to date"


def reusable_timing_cache(previous: EngineManifest | None, tensorrt_version: str,
                          device: DeviceInfo) -> bool:
    """A timing cache is only worth loading when the same TensorRT version on the same GPU wrote it."""
    return previous is not None and previous.tensorrt_version == tensorrt_version \
        and previous.device.differs(device) is None


def validate(em: EngineManifest, artifact: Manifest, tensorrt_version: str, device: DeviceInfo,
             engine_dir, artifact_dir) -> None:
    """Refuse engines that cannot run here, with the rebuild command. Checks no plan bytes."""
    hint = rebuild_hint(artifact_dir)
    if em.tensorrt_version != tensorrt_version:
        raise EngineMismatchError(
            f"the engines in {engine_dir} were built with TensorRT {em.tensorrt_version}, but this "
            f"is TensorRT {tensorrt_version}: a TensorRT plan loads only in the version that built "
            f"it; {hint}")
    why = em.device.differs(device)
    if why:
        raise EngineMismatchError(
            f"the engines in {engine_dir} were built for {em.device.describe()}, but this GPU is "
            f"{device.describe()} ({why}): a TensorRT plan is tuned for one GPU; {hint} on this device")
    if em.artifact.get("dtype") != artifact.dtype:
        raise EngineMismatchError(
            f"the engines in {engine_dir} were built from a {em.artifact.get('dtype')} export, but "
            f"the artifact is {artifact.dtype}; {hint}")
    for spec in artifact.graphs:
        entry = em.engines.get(spec.name)
        if entry is None:
            raise EngineMismatchError(
                f"the engines in {engine_dir} have no engine for {spec.name} (the build was "
                f"interrupted or is from another model); finish it with `python -m engines build "
                f"{artifact_dir}` (it resumes)")
        source = source_hashes(artifact, spec)
        if entry.source != source:
            changed = sorted(k for k in set(source) | set(entry.source) if source.get(k) != entry.source.get(k))
            raise EngineMismatchError(
                f"{', '.join(changed)} changed since the {spec.name} engine was built (built from "
                f"sha256 {_short(entry.source, changed)}, the artifact has {_short(source, changed)}); {hint}")
        if entry.settings_key != em.settings_key:
            raise EngineMismatchError(
                f"the {spec.name} engine in {engine_dir} was built with other settings than the "
                f"rest (an interrupted rebuild); finish it with `python -m engines build "
                f"{artifact_dir}` and the same flags")


def _short(hashes: dict, keys: list) -> str:
    return ", ".join((hashes.get(k) or "none")[:12] for k in keys)
