"""``python -m engines build``: one TensorRT engine per graph of an artifact, resumable and atomic.

Every plan is written to a temporary file and renamed into place, then the engine manifest
(engines.json) is rewritten atomically with its entry, then the shared timing cache. An
interrupted build therefore keeps every engine it finished; a rerun skips the engines whose
source graph, settings, TensorRT version and GPU all match (``manifest.build_decision``) and
builds the rest. The artifact directory itself is never written, except the engines/ folder in it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.artifact.manifest import load_manifest

from .atomic import write_bytes_atomic
from .config import EngineBuildConfig, format_size
from .manifest import (DEFAULT_ENGINE_DIR, TIMING_CACHE, EngineEntry, EngineManifest, build_decision,
                       plan_name, read_engine_manifest, reusable_timing_cache, settings_key,
                       source_hashes)
from .errors import EngineMismatchError
from .profiles import graph_profiles
from .versions import network_plan


@dataclass
class BuildReport:
    engine_dir: Path
    manifest: EngineManifest
    built: list[str] = field(default_factory=list)  # graphs built by this run
    skipped: list[str] = field(default_factory=list)  # graphs whose engine was up to date
    reasons: dict = field(default_factory=dict)  # graph -> why it was (re)built or skipped


def engine_settings(config: EngineBuildConfig, plan) -> dict:
    """Everything of a build that changes a plan, as recorded in the manifest."""
    return {"max_batch": config.max_batch, "max_seq": config.max_seq,
            "max_prompt": config.prompt_limit, "workspace": config.workspace, **plan.to_dict()}


def build_engines(artifact_dir, config: EngineBuildConfig, engine_dir=None, force: bool = False,
                  progress: bool = True, log=print, toolchain=None) -> BuildReport:
    """Build (or finish) the engines of ``artifact_dir`` into ``engine_dir`` (default ARTIFACT/engines).

    toolchain: what compiles graphs (default: the installed TensorRT on the current GPU, see
        builder.TensorRTToolchain); it is asked for first, so a missing TensorRT fails fast.
    """
    if toolchain is None:
        from .builder import TensorRTToolchain

        toolchain = TensorRTToolchain()
    artifact_dir = Path(artifact_dir)
    artifact = load_manifest(artifact_dir)
    config.validate(artifact.model)
    plan = network_plan(toolchain.version, artifact.dtype, config.precision)
    if config.precision == "fp16" and artifact.dtype == "float32":
        log("NOTE: --fp16 on an fp32 export lets TensorRT choose fp16 per layer (weak typing); for "
            "fp16 engines prefer `python -m export build --dtype fp16`, whose casts are explicit")
    engine_dir = Path(engine_dir) if engine_dir is not None else artifact_dir / DEFAULT_ENGINE_DIR
    engine_dir.mkdir(parents=True, exist_ok=True)
    settings = engine_settings(config, plan)
    key = settings_key(settings, toolchain.version, toolchain.device)

    previous = None
    if (engine_dir / "engines.json").exists():
        try:
            previous = read_engine_manifest(engine_dir, artifact_dir)
        except EngineMismatchError as exc:
            log(f"starting over: {exc}")
    cache_path = Path(config.timing_cache) if config.timing_cache else engine_dir / TIMING_CACHE
    cache_bytes = None
    if cache_path.is_file() and (config.timing_cache or reusable_timing_cache(
            previous, toolchain.version, toolchain.device)):
        cache_bytes = cache_path.read_bytes()

    kept = {}
    if previous is not None:
        names = {g.name for g in artifact.graphs}
        kept = {k: v for k, v in previous.engines.items() if k in names}
    manifest = EngineManifest(
        tensorrt_version=toolchain.version, device=toolchain.device, settings=settings,
        settings_key=key, artifact={"dtype": artifact.dtype, "num_layers": artifact.model.num_layers},
        engines=kept, timing_cache=str(cache_path) if config.timing_cache else TIMING_CACHE)
    report = BuildReport(engine_dir, manifest)
    todo = []
    for spec in artifact.graphs:
        needed, why = build_decision(kept.get(spec.name), source_hashes(artifact, spec), key,
                                     engine_dir, force)
        report.reasons[spec.name] = why
        if needed:
            todo.append(spec)
        else:
            report.skipped.append(spec.name)
    log(f"engines for {artifact_dir} in {engine_dir}: TensorRT {toolchain.version} on "
        f"{toolchain.device.describe()}, {plan.precision}"
        f"{' strongly typed' if plan.strongly_typed else ''}, batch <= {config.max_batch}, "
        f"sequence <= {config.max_seq}, prompt <= {config.prompt_limit}, workspace "
        f"{format_size(config.workspace)}; {len(todo)} to build, {len(report.skipped)} up to date")
    manifest.save(engine_dir)  # the new header first: stale entries now fail validation
    if not todo:
        return report

    from tqdm.auto import tqdm

    # Lines printed during the build go through tqdm so they do not tear the progress bar.
    compiler = toolchain.compiler(plan, config, cache_bytes,
                                  log=tqdm.write if progress and log is print else log)
    bar = tqdm(todo, desc="build engines", unit="engine", disable=not progress)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        profiles = graph_profiles(spec, config, artifact.page_size)
        started = time.perf_counter()
        data = compiler.compile(spec, artifact_dir / spec.file, profiles)
        view = memoryview(data)
        path = engine_dir / plan_name(spec.name)
        write_bytes_atomic(path, view)
        manifest.engines[spec.name] = EngineEntry(
            graph=spec.name, plan=path.name, plan_sha256=hashlib.sha256(view).hexdigest(),
            plan_bytes=view.nbytes, source=source_hashes(artifact, spec), settings_key=key,
            profiles=[p.to_dict() for p in profiles],
            build_seconds=round(time.perf_counter() - started, 3))
        manifest.save(engine_dir)  # after the plan: an entry never names a plan not yet in place
        write_bytes_atomic(cache_path, compiler.timing_cache())
        report.built.append(spec.name)
    return report
