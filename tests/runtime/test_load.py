import json
import platform
import shutil
import warnings

import pytest

import runtime
from runtime.backends.onnxruntime import SPIN_US
from runtime.errors import ArtifactError, InvalidArgumentError
from runtime.manifest import MANIFEST_NAME


@pytest.fixture
def copy(artifact_dir, tmp_path):
    target = tmp_path / "artifact"
    shutil.copytree(artifact_dir, target)
    return target


def edit_manifest(directory, change):
    path = directory / MANIFEST_NAME
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_missing_directory(tmp_path):
    with pytest.raises(ArtifactError, match=f"artifact directory {tmp_path / 'none'} does not exist; rebuild it"):
        runtime.load(tmp_path / "none")


def test_tampered_graph_fails_its_hash(copy):
    path = copy / "layer_02.onnx"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # same size, one byte changed
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as info:
        runtime.load(copy)
    assert f"{path} does not match its sha256 in manifest.json" in str(info.value)
    assert "modified or corrupted after export" in str(info.value)


def test_truncated_file_fails_its_size(copy):
    path = copy / "head.onnx"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ArtifactError, match=f"{path} has 100 bytes, the manifest says"):
        runtime.load(copy, check_hashes=False)


def test_missing_file(copy):
    (copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is named in manifest.json but missing"):
        runtime.load(copy)


@pytest.mark.parametrize("old", [1, 2])  # 2: the paged past of the engine before the KV cache object
def test_other_schema_version(copy, old):
    edit_manifest(copy, lambda d: d.update(schema_version=old))
    with pytest.raises(ArtifactError) as info:
        runtime.load(copy)
    assert f"has schema_version {old}, but this runtime reads schema_version 3" in str(info.value)
    assert "re-export the model" in str(info.value)


def test_kv_layout_is_checked(copy):
    edit_manifest(copy, lambda d: d.update(kv_cache={"layout": "contiguous", "page_size": 32}))
    with pytest.raises(ArtifactError, match="kv_cache .* is not a 'rows' layout with an int page_size >= 1"):
        runtime.load(copy)


def test_corrupt_manifest(copy):
    (copy / MANIFEST_NAME).write_text('{"schema_version": 1, "graphs": [')
    with pytest.raises(ArtifactError, match="manifest.json is not valid JSON"):
        runtime.load(copy)


def test_manifest_missing_a_field(copy):
    edit_manifest(copy, lambda d: d.pop("graphs"))
    with pytest.raises(ArtifactError, match="is missing or has malformed field 'graphs'"):
        runtime.load(copy)


def test_graph_io_names_are_checked_against_the_manifest(copy):
    def rename(d):
        d["graphs"][1]["inputs"][2]["name"] = "past_keys"

    edit_manifest(copy, rename)
    with pytest.raises(ArtifactError) as info:
        runtime.load(copy)
    assert "layer_00.onnx has inputs ['hidden_states', 'attention_mask', 'past_key', 'past_value']" in str(info.value)
    assert "graph and manifest come from different exports" in str(info.value)


def test_layer_count_mismatch(copy):
    edit_manifest(copy, lambda d: d["model"].update(num_layers=d["model"]["num_layers"] + 1))
    with pytest.raises(ArtifactError, match="lists graphs .* expected .* for a 7-layer model"):
        runtime.load(copy)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="ONNX Runtime's fp16 CPU kernels differ on ARM64; the warning is for x86")
def test_fp16_on_an_x86_cpu_warns_and_names_the_fix(fp16_artifact_dir, artifact_dir):
    with pytest.warns(UserWarning, match=r"x86 kernels compute in float32.*--dtype fp32, or "
                                         r"--weights int8/int4") as caught:
        runtime.load(fp16_artifact_dir, threads=1).close()
    assert caught[0].filename == __file__  # it names the caller's line, not the runtime's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime.load(artifact_dir, threads=1).close()  # float32: nothing to say


def _spin_settings(generator) -> set[tuple[str, str | None]]:
    """(allow_spinning, spin_duration_us, force_spinning_stop) of every graph's session; None where not set."""
    def entry(config, key):
        try:
            return config.get_session_config_entry(key)
        except RuntimeError:  # ONNX Runtime's answer for a key never set
            return None

    keys = ("session.intra_op.allow_spinning", "session.intra_op.spin_duration_us", "session.force_spinning_stop")
    return {tuple(entry(s.get_session_options(), k) for k in keys) for s in generator.backend._sessions.values()}


def test_spin_reaches_every_session_and_changes_no_token(artifact_dir):
    # Default: every graph's workers sleep whenever they wait; spin=True: they busy-wait at most
    # SPIN_US, and stop when their graph's run returns, so the pools of the graphs not running
    # never compete for the cores.
    with runtime.load(artifact_dir, check_hashes=False, max_batch=1) as sleeping, \
            runtime.load(artifact_dir, check_hashes=False, max_batch=1, spin=True) as spinning:
        assert _spin_settings(spinning) == {("1", str(SPIN_US), "1")}
        assert _spin_settings(sleeping) == {("0", None, None)}
        a = spinning.generate("Hello, my name is", 8, ignore_eos=True)
        b = sleeping.generate("Hello, my name is", 8, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_huge_pages_change_no_token(artifact_dir):
    with runtime.load(artifact_dir, check_hashes=False, max_batch=1, huge_pages=True) as huge, \
            runtime.load(artifact_dir, check_hashes=False, max_batch=1) as plain:
        assert plain.backend.huge_page_bytes == 0
        a = huge.generate("Hello, my name is", 8, ignore_eos=True)
        b = plain.generate("Hello, my name is", 8, ignore_eos=True)
    assert a.token_ids == b.token_ids
    with pytest.raises(InvalidArgumentError, match=r"huge_pages must be True .* or False .*, got 1"):
        runtime.load(artifact_dir, huge_pages=1)


def test_spin_must_be_a_bool(artifact_dir):
    with pytest.raises(InvalidArgumentError, match=r"spin must be True .* or False .*, got 'no'"):
        runtime.load(artifact_dir, spin="no")
