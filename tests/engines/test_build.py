"""The resumable, atomic build loop, with a fake toolchain in place of TensorRT's builder."""

import json
import shutil

import onnx
import pytest

from engines import build as build_module
from engines.atomic import write_atomic
from engines.build import build_engines
from engines.config import EngineBuildConfig
from engines.errors import EngineConfigError
from engines.manifest import ENGINE_MANIFEST, TIMING_CACHE, read_engine_manifest, validate
from engines.profiles import graph_profiles
from runtime.artifact.manifest import Manifest, file_entry, load_manifest, sha256_file
from runtime.errors import ArtifactError
from tests.engines.fakes import ORIN, FakeToolchain, SimulatedCrash

LIMITS = dict(max_batch=4, max_seq=32, max_prompt=16)


def build(artifact, engine_dir, toolchain=None, force=False, logs=None, **overrides):
    config = EngineBuildConfig(**{**LIMITS, **overrides})
    log = logs.append if logs is not None else (lambda *_: None)
    return build_engines(artifact, config, engine_dir=engine_dir, force=force, progress=False, log=log,
                         toolchain=toolchain or FakeToolchain())


def graph_names(artifact):
    return [g.name for g in load_manifest(artifact, check_hashes=False).graphs]


def leftovers(directory):
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def test_first_build_writes_every_engine(artifact_dir, tmp_path):
    toolchain = FakeToolchain()
    report = build(artifact_dir, tmp_path, toolchain)
    names = graph_names(artifact_dir)
    assert report.built == toolchain.compiled == names and report.skipped == []
    em = read_engine_manifest(tmp_path)
    assert list(em.engines) == names
    assert (em.tensorrt_version, em.device, em.timing_cache) == ("10.3.0", ORIN, TIMING_CACHE)
    assert em.settings == {"max_batch": 4, "max_seq": 32, "max_prompt": 16, "workspace": 2 * 1024**3,
                           "precision": "fp32", "explicit_batch": False, "strongly_typed": False,
                           "fp16_flag": False, "fp32_layers": False}
    artifact = load_manifest(artifact_dir)
    config = EngineBuildConfig(**LIMITS)
    for spec in artifact.graphs:
        entry = em.engines[spec.name]
        plan = tmp_path / entry.plan
        assert entry.plan == f"{spec.name}.plan" and plan.stat().st_size == entry.plan_bytes
        assert sha256_file(plan) == entry.plan_sha256
        # the graph and the weights it reads (weights.bin, shared by every graph)
        assert entry.source == {rel: artifact.files[rel]["sha256"] for rel in (spec.file, spec.data_file)}
        assert entry.profiles == [p.to_dict() for p in graph_profiles(spec, config, 32)]  # the artifacts' page
        assert entry.settings_key == em.settings_key
    assert (tmp_path / TIMING_CACHE).read_bytes() == ",".join(names).encode()
    assert leftovers(tmp_path) == []
    validate(em, artifact, "10.3.0", ORIN, tmp_path, artifact_dir)


def test_default_engine_dir_is_inside_the_artifact(artifact_dir, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(artifact_dir, artifact)
    report = build(artifact, None)
    assert report.engine_dir == artifact / "engines" and (artifact / "engines" / ENGINE_MANIFEST).is_file()
    load_manifest(artifact)  # the engines folder does not disturb the artifact's own checks


def test_rerun_skips_up_to_date_engines(artifact_dir, tmp_path):
    build(artifact_dir, tmp_path)
    toolchain = FakeToolchain()
    report = build(artifact_dir, tmp_path, toolchain)
    assert toolchain.compiled == [] and report.built == []
    assert report.skipped == graph_names(artifact_dir)
    assert set(report.reasons.values()) == {"up to date"}


def test_changed_settings_rebuild_everything(artifact_dir, tmp_path):
    build(artifact_dir, tmp_path)
    toolchain = FakeToolchain()
    report = build(artifact_dir, tmp_path, toolchain, max_seq=48)
    assert toolchain.compiled == graph_names(artifact_dir)
    assert set(report.reasons.values()) == {"the settings, TensorRT version or GPU changed"}
    assert toolchain.caches_seen == [",".join(graph_names(artifact_dir)).encode()]  # same TRT + GPU: cache kept
    assert read_engine_manifest(tmp_path).settings["max_seq"] == 48


def test_other_tensorrt_version_rebuilds_without_its_timing_cache(artifact_dir, tmp_path):
    build(artifact_dir, tmp_path, FakeToolchain("8.6.2.3"))
    toolchain = FakeToolchain("10.3.0")
    build(artifact_dir, tmp_path, toolchain)
    assert toolchain.compiled == graph_names(artifact_dir)
    assert toolchain.caches_seen == [None]  # a cache of another TensorRT version is not loaded


def changed_graph_copy(artifact_dir, target, graph="layer_02"):
    """A re-export in which one graph changed (a valid ONNX with other bytes, manifest updated)."""
    shutil.copytree(artifact_dir, target)
    path = target / f"{graph}.onnx"
    model = onnx.load(str(path))
    model.doc_string = "changed"
    onnx.save(model, str(path))
    manifest = Manifest.from_dict(json.loads((target / "manifest.json").read_text()))
    manifest.files[f"{graph}.onnx"] = file_entry(path)
    manifest.save(target)
    return target


def test_changed_source_rebuilds_only_that_engine(artifact_dir, tmp_path):
    artifact = changed_graph_copy(artifact_dir, tmp_path / "artifact")
    shutil.copytree(artifact_dir, tmp_path / "original")
    engines = tmp_path / "engines"
    build(tmp_path / "original", engines)
    toolchain = FakeToolchain()
    report = build(artifact, engines, toolchain)
    assert toolchain.compiled == ["layer_02"]
    assert report.reasons["layer_02"] == "its source graph changed"
    validate(read_engine_manifest(engines), load_manifest(artifact), "10.3.0", ORIN, engines, artifact)


def test_interrupted_build_keeps_finished_engines_and_resumes(artifact_dir, tmp_path):
    with pytest.raises(SimulatedCrash):
        build(artifact_dir, tmp_path, FakeToolchain(fail_on="layer_02"))
    em = read_engine_manifest(tmp_path)
    assert list(em.engines) == ["embed", "layer_00", "layer_01"]
    assert sorted(p.name for p in tmp_path.glob("*.plan")) == ["embed.plan", "layer_00.plan", "layer_01.plan"]
    assert leftovers(tmp_path) == []

    toolchain = FakeToolchain()
    report = build(artifact_dir, tmp_path, toolchain)
    names = graph_names(artifact_dir)
    assert toolchain.compiled == names[3:] and report.skipped == names[:3]
    assert toolchain.caches_seen == [b"embed,layer_00,layer_01"]  # the timing cache survived the crash
    validate(read_engine_manifest(tmp_path), load_manifest(artifact_dir), "10.3.0", ORIN, tmp_path, artifact_dir)


def test_missing_plan_is_rebuilt(artifact_dir, tmp_path):
    build(artifact_dir, tmp_path)
    (tmp_path / "head.plan").unlink()
    toolchain = FakeToolchain()
    report = build(artifact_dir, tmp_path, toolchain)
    assert toolchain.compiled == ["head"] and report.reasons["head"] == "its plan file is missing"


def test_force_rebuilds_everything(artifact_dir, tmp_path):
    build(artifact_dir, tmp_path)
    toolchain = FakeToolchain()
    report = build(artifact_dir, tmp_path, toolchain, force=True)
    assert toolchain.compiled == graph_names(artifact_dir)
    assert set(report.reasons.values()) == {"forced (--force)"}


def test_failed_plan_write_leaves_the_previous_plan(artifact_dir, tmp_path, monkeypatch):
    build(artifact_dir, tmp_path)
    before = (tmp_path / "layer_01.plan").read_bytes()

    def crash_on_layer_01(path, data):
        def half_then_fail(f):
            f.write(bytes(data)[: len(data) // 2])
            raise OSError("disk full")
        if path.name == "layer_01.plan":
            write_atomic(path, half_then_fail)
        write_atomic(path, lambda f: f.write(data))

    monkeypatch.setattr(build_module, "write_bytes_atomic", crash_on_layer_01)
    with pytest.raises(OSError, match="disk full"):
        build(artifact_dir, tmp_path, force=True, max_seq=48)
    assert (tmp_path / "layer_01.plan").read_bytes() == before
    assert leftovers(tmp_path) == []
    em = read_engine_manifest(tmp_path)
    assert em.engines["layer_01"].plan_sha256 == sha256_file(tmp_path / "layer_01.plan")
    assert em.engines["layer_00"].settings_key == em.settings_key != em.engines["layer_01"].settings_key


def test_write_atomic_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "x.plan"
    path.write_bytes(b"old plan")

    def writer(f):
        f.write(b"new pl")
        raise KeyboardInterrupt  # even an interrupt mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, writer)
    assert path.read_bytes() == b"old plan" and leftovers(tmp_path) == []
    write_atomic(path, lambda f: f.write(b"new plan"))
    assert path.read_bytes() == b"new plan" and leftovers(tmp_path) == []


def test_limits_are_checked_before_any_build(artifact_dir, tmp_path):
    toolchain = FakeToolchain()
    with pytest.raises(EngineConfigError, match="max_seq 65 exceeds max_position_embeddings 64"):
        build(artifact_dir, tmp_path, toolchain, max_seq=65, max_prompt=None)
    assert toolchain.compiled == []


def test_fp16_from_an_fp32_export(artifact_dir, tmp_path):
    logs = []
    toolchain = FakeToolchain("8.6.2.3")
    build(artifact_dir, tmp_path, toolchain, logs=logs, precision="fp16")
    assert toolchain.plans[0].fp16_flag and toolchain.plans[0].fp32_layers and toolchain.plans[0].explicit_batch
    assert any(line.startswith("NOTE: --fp16 on an fp32 export") for line in logs)
    assert read_engine_manifest(tmp_path).settings["precision"] == "fp16"


def test_real_tensorrt_build(artifact_dir, tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed here (it cannot be on these machines)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT is installed but PyTorch sees no CUDA GPU")
    report = build_engines(artifact_dir, EngineBuildConfig(**LIMITS, workspace=256 * 1024**2),
                           engine_dir=tmp_path, progress=False, log=print)
    assert report.built == graph_names(artifact_dir)


@pytest.mark.parametrize("plan", ["../../etc/passwd", "/etc/passwd"])
def test_engine_manifest_cannot_name_plans_outside_its_directory(artifact_dir, tmp_path, plan):
    build(artifact_dir, tmp_path)
    data = json.loads((tmp_path / ENGINE_MANIFEST).read_text())
    data["engines"]["head"]["plan"] = plan
    (tmp_path / ENGINE_MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=f"names {plan!r}, a path outside its directory {tmp_path}"):
        read_engine_manifest(tmp_path)
