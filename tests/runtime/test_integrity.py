"""Fast loads that still catch corruption (a fingerprint record of the last full sha256), and
manifests that cannot name files outside their artifact."""

import json
import os
import shutil

import pytest

import runtime
from runtime.artifact import integrity
from runtime.artifact.manifest import MANIFEST_NAME, load_manifest
from runtime.errors import ArtifactError


@pytest.fixture
def copy(artifact_dir, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(artifact_dir, target)
    return target


@pytest.fixture
def hashed(monkeypatch):
    """The relative paths each load hashes."""
    seen = []
    real = integrity.sha256_file

    def counting(path, *args, **kwargs):
        seen.append(path.name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(integrity, "sha256_file", counting)
    return seen


def test_export_records_its_hashes_so_loads_hash_nothing(artifact_dir, hashed):
    manifest = load_manifest(artifact_dir)
    assert hashed == [] and (artifact_dir / integrity.VERIFIED_NAME).is_file()
    load_manifest(artifact_dir, check_hashes="full")
    assert len(hashed) == len(manifest.files)  # "full" hashes every byte, whatever the record says


def test_a_copied_artifact_is_hashed_once(copy, hashed):
    manifest = load_manifest(copy)  # new inodes: nothing in the record holds
    assert len(hashed) == len(manifest.files)
    hashed.clear()
    load_manifest(copy)
    assert hashed == []


def test_a_file_changed_after_the_record_is_caught(copy, hashed):
    load_manifest(copy)
    path = copy / "layer_01.onnx"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # same size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the mtime put back (ctime moves)
    hashed.clear()
    with pytest.raises(ArtifactError, match=f"{path} does not match its sha256 in manifest.json"):
        runtime.load(copy)
    assert hashed == ["layer_01.onnx"]  # only the changed file was hashed


def test_a_forged_record_does_not_pass_a_changed_manifest_hash(copy):
    """The record is a cache: the expected sha256 always comes from the manifest."""
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["files"]["head.onnx"]["sha256"] = "0" * 64
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="head.onnx does not match its sha256"):
        load_manifest(copy)


def test_check_hashes_takes_true_false_or_full(copy):
    with pytest.raises(ArtifactError, match="check_hashes must be True, False or 'full', got 'yes'"):
        load_manifest(copy, check_hashes="yes")


def test_unwritable_artifact_still_loads(copy, monkeypatch, hashed):
    """The record is best effort: without it every load hashes, and nothing fails."""
    (copy / integrity.VERIFIED_NAME).unlink()

    def refuse(*args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(integrity.os, "replace", refuse)
    manifest = load_manifest(copy)
    load_manifest(copy)
    assert len(hashed) == 2 * len(manifest.files) and not (copy / integrity.VERIFIED_NAME).exists()
    assert not list(copy.glob(integrity.VERIFIED_NAME + ".tmp-*"))


# -- nothing outside the artifact ---------------------------------------------------------------

def _rename_file(copy, old, new):
    data = json.loads((copy / MANIFEST_NAME).read_text())
    data["files"][new] = data["files"].pop(old)
    for g in data["graphs"]:
        if g["file"] == old:
            g["file"] = new
    (copy / MANIFEST_NAME).write_text(json.dumps(data))


@pytest.mark.parametrize("name", ["../outside.onnx", "../../etc/passwd", "/etc/passwd", "sub/../../x.onnx",
                                  "C:\\\\x.onnx"])
def test_manifest_paths_outside_the_artifact_are_refused(copy, name):
    _rename_file(copy, "head.onnx", name)
    with pytest.raises(ArtifactError) as info:
        runtime.load(copy)
    assert f"names {name!r}, a path outside its directory {copy}" in str(info.value)
    assert "no absolute paths, no '..'" in str(info.value)


def test_links_that_leave_the_artifact_are_refused(copy, tmp_path):
    outside = tmp_path / "outside.onnx"
    shutil.copy(copy / "head.onnx", outside)
    (copy / "head.onnx").unlink()
    (copy / "head.onnx").symlink_to(outside)
    with pytest.raises(ArtifactError, match=f"names 'head.onnx', which is a link that leads outside {copy}"):
        runtime.load(copy)


def test_tokenizer_dir_outside_is_refused(copy):
    data = json.loads((copy / MANIFEST_NAME).read_text())
    data["tokenizer_dir"] = "../elsewhere"
    (copy / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="names '../elsewhere', a path outside"):
        runtime.load(copy)
