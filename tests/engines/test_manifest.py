"""engines.json: load-time validation (exact messages), resume decisions, reading errors."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from engines.build import build_engines
from engines.config import EngineBuildConfig
from engines.device import DeviceInfo
from engines.errors import EngineMismatchError
from engines.manifest import (ENGINE_MANIFEST, EngineManifest, build_decision, read_engine_manifest,
                              reusable_timing_cache, settings_key, validate)
from runtime.artifact.manifest import load_manifest
from runtime.errors import ArtifactError
from tests.engines.fakes import ORIN, FakeToolchain

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", "9.0")


@pytest.fixture
def built(artifact_dir, tmp_path):
    build_engines(artifact_dir, EngineBuildConfig(max_batch=4, max_seq=32, max_prompt=16), engine_dir=tmp_path,
                  progress=False, log=lambda *_: None, toolchain=FakeToolchain("10.3.0", ORIN))
    return read_engine_manifest(tmp_path), load_manifest(artifact_dir), tmp_path, artifact_dir


def check(built, version="10.3.0", device=ORIN):
    em, artifact, engine_dir, artifact_dir = built
    validate(em, artifact, version, device, engine_dir, artifact_dir)


def message(built, **kwargs):
    with pytest.raises(EngineMismatchError) as info:
        check(built, **kwargs)
    assert isinstance(info.value, ArtifactError)  # callers catching ArtifactError see it too
    return str(info.value)


def test_valid_engines_pass(built):
    check(built)


def test_other_tensorrt_version(built):
    _, _, engine_dir, artifact_dir = built
    assert message(built, version="8.6.2.3") == (
        f"the engines in {engine_dir} were built with TensorRT 10.3.0, but this is TensorRT 8.6.2.3: "
        f"a TensorRT plan loads only in the version that built it; rebuild with "
        f"`python -m engines build {artifact_dir}`")


def test_other_gpu(built):
    _, _, engine_dir, artifact_dir = built
    assert message(built, device=H100) == (
        f"the engines in {engine_dir} were built for Orin (compute capability 8.7), but this GPU is "
        f"NVIDIA H100 80GB HBM3 (compute capability 9.0) (another GPU model): a TensorRT plan is tuned for one "
        f"GPU; rebuild with `python -m engines build {artifact_dir}` on this device")


def test_same_gpu_name_other_compute_capability(built):
    assert "but this GPU is Orin (compute capability 8.6)" in message(built, device=DeviceInfo("Orin", "8.6"))


AGX = DeviceInfo("Orin", "8.7", "NVIDIA Jetson AGX Orin Developer Kit", 16, 62_841)
NANO = DeviceInfo("Orin", "8.7", "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", 8, 7_620)


@pytest.fixture
def built_on_agx(artifact_dir, tmp_path):
    build_engines(artifact_dir, EngineBuildConfig(max_batch=4, max_seq=32, max_prompt=16), engine_dir=tmp_path,
                  progress=False, log=lambda *_: None, toolchain=FakeToolchain("10.3.0", AGX))
    return read_engine_manifest(tmp_path), load_manifest(artifact_dir), tmp_path, artifact_dir


def test_an_engine_of_another_orin_module_is_refused(built_on_agx):
    """Every Orin reports "Orin" and 8.7: the module, its SMs and its memory tell them apart."""
    _, _, engine_dir, artifact_dir = built_on_agx
    assert message(built_on_agx, device=NANO) == (
        f"the engines in {engine_dir} were built for Orin (compute capability 8.7, NVIDIA Jetson AGX Orin "
        f"Developer Kit, 16 SMs, 61.4 GiB), but this GPU is Orin (compute capability 8.7, NVIDIA Jetson Orin "
        f"Nano Engineering Reference Developer Kit Super, 8 SMs, 7.4 GiB) (another module): a TensorRT plan "
        f"is tuned for one GPU; rebuild with `python -m engines build {artifact_dir}` on this device")
    unnamed = dict(module=None)  # a board whose device tree names no module
    assert "(16 SMs against 8)" in message(built_on_agx, device=replace(NANO, **unnamed))
    orin_nx_8gb = replace(AGX, multiprocessors=16, memory_mib=7_620, **unnamed)
    assert "(another memory size)" in message(built_on_agx, device=orin_nx_8gb)


def test_the_same_module_after_its_memory_carve_outs_moved_is_accepted(built_on_agx):
    check(built_on_agx, device=replace(AGX, memory_mib=62_000))  # another JetPack release


def test_an_engine_manifest_without_the_module_is_judged_on_name_and_capability(built):
    check(built, device=AGX)  # written before modules were recorded: not refused for lacking them
    em = built[0]
    assert "module" not in em.device.to_dict() and EngineManifest.from_dict(em.to_dict()).device == ORIN


def test_the_current_device_names_its_module(monkeypatch, tmp_path):
    import torch

    from engines import device as device_module

    model = tmp_path / "model"  # as /proc/device-tree/model holds it: NUL-terminated
    model.write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00")
    assert device_module.board_model(model) == NANO.module
    assert device_module.board_model(tmp_path / "absent") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 7))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Orin")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=8, total_memory=7_620 << 20))
    monkeypatch.setattr(device_module, "board_model", lambda: NANO.module)
    assert device_module.current_device() == NANO


def test_changed_source_graph(built):
    _, artifact, _, artifact_dir = built
    old = artifact.files["layer_02.onnx"]["sha256"]
    artifact.files["layer_02.onnx"] = {**artifact.files["layer_02.onnx"], "sha256": "f" * 64}
    assert message(built) == (
        f"layer_02.onnx changed since the layer_02 engine was built (built from sha256 {old[:12]}, "
        f"the artifact has ffffffffffff); rebuild with `python -m engines build {artifact_dir}`")


def test_missing_engine(built):
    em, _, engine_dir, artifact_dir = built
    del em.engines["head"]
    assert message(built) == (
        f"the engines in {engine_dir} have no engine for head (the build was interrupted or is from "
        f"another model); finish it with `python -m engines build {artifact_dir}` (it resumes)")


def test_engine_of_other_settings(built):
    em, _, engine_dir, artifact_dir = built
    em.engines["layer_01"].settings_key = "0" * 16
    assert message(built) == (
        f"the layer_01 engine in {engine_dir} was built with other settings than the rest (an "
        f"interrupted rebuild); finish it with `python -m engines build {artifact_dir}` and the same flags")


def test_other_dtype(built):
    em, _, engine_dir, _ = built
    em.artifact["dtype"] = "float16"
    assert message(built).startswith(
        f"the engines in {engine_dir} were built from a float16 export, but the artifact is float32")


def test_round_trip(built):
    em = built[0]
    assert EngineManifest.from_dict(json.loads(json.dumps(em.to_dict()))) == em


def test_read_missing(tmp_path):
    with pytest.raises(EngineMismatchError) as info:
        read_engine_manifest(tmp_path / "engines", "artifacts/opt")
    assert str(info.value) == (f"{tmp_path / 'engines'} has no engines.json: no TensorRT engines were built "
                               f"there; build them on this device with `python -m engines build artifacts/opt`")


def test_read_corrupt(tmp_path):
    (tmp_path / ENGINE_MANIFEST).write_text("{not json")
    with pytest.raises(EngineMismatchError, match="engines.json is unreadable"):
        read_engine_manifest(tmp_path, "A")


def test_read_other_schema(built):
    _, _, engine_dir, _ = built
    data = json.loads((engine_dir / ENGINE_MANIFEST).read_text())
    data["schema_version"] = 2
    (engine_dir / ENGINE_MANIFEST).write_text(json.dumps(data))
    with pytest.raises(EngineMismatchError,
                       match="has format 'skipdecode-trt-engines' schema_version 2, this toolkit reads"):
        read_engine_manifest(engine_dir, "A")


def test_build_decision(built):
    em, _, engine_dir, _ = built
    entry = em.engines["layer_00"]
    source, key = entry.source, em.settings_key
    assert build_decision(entry, source, key, engine_dir) == (False, "up to date")
    assert build_decision(entry, source, key, engine_dir, force=True) == (True, "forced (--force)")
    assert build_decision(None, source, key, engine_dir) == (True, "not built yet")
    assert build_decision(entry, {"layer_00.onnx": "0" * 64}, key, engine_dir) == (True, "its source graph changed")
    assert build_decision(entry, source, "other", engine_dir) == (True, "the settings, TensorRT version or GPU changed")
    (engine_dir / entry.plan).write_bytes(b"short")
    assert build_decision(entry, source, key, engine_dir) == (
        True, "its plan file has the wrong size (truncated or replaced)")
    (engine_dir / entry.plan).unlink()
    assert build_decision(entry, source, key, engine_dir) == (True, "its plan file is missing")


def test_settings_key_covers_version_and_gpu():
    settings = {"max_batch": 8}
    key = settings_key(settings, "10.3.0", ORIN)
    assert key == settings_key(dict(settings), "10.3.0", DeviceInfo("Orin", "8.7"))
    assert len({key, settings_key({"max_batch": 4}, "10.3.0", ORIN), settings_key(settings, "10.3.1", ORIN),
                settings_key(settings, "10.3.0", H100)}) == 4


def test_reusable_timing_cache(built):
    em = built[0]
    assert reusable_timing_cache(em, "10.3.0", ORIN)
    assert not reusable_timing_cache(em, "8.6.2.3", ORIN)
    assert not reusable_timing_cache(em, "10.3.0", H100)
    assert not reusable_timing_cache(None, "10.3.0", ORIN)
