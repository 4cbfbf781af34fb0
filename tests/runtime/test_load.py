import json
import platform
import re
import shutil
import warnings

import pytest

import runtime
from runtime.artifact.manifest import MANIFEST_NAME
from runtime.backends.onnxruntime import SPIN_US
from runtime.errors import ArtifactError, InvalidArgumentError


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


@pytest.mark.parametrize("change, message", [
    (lambda d: d["policy"].pop("min_layers"), "policy {'max_layers': 6, 'warmup_layers': 1, 'horizon': None} "
                                               "is not a valid skip policy (min_layers is required with max_layers: "
                                               "max_layers and min_layers go together)"),
    (lambda d: d["policy"].update(min_layers=9), "is not a valid skip policy (min_layers (9) must be <= "
                                                  "max_layers (6): the budget only decays)"),
    (lambda d: d["model"].update(num_heads=0), "model {'num_heads': 0} must be ints >= 1"),
    (lambda d: d["model"].update(eos_token_id=99999), "token ids {'eos_token_id': 99999} are outside the "
                                                      "vocabulary (0 to 511)"),
])
def test_a_manifest_that_parses_but_is_wrong_is_refused_at_load(copy, change, message):
    edit_manifest(copy, change)
    with pytest.raises(ArtifactError) as info:
        runtime.load(copy)
    assert message in str(info.value) and "rebuild" in str(info.value)


def test_a_wrong_head_dim_is_refused_at_load_in_the_manifest_or_against_the_graph(copy):
    model = json.loads((copy / MANIFEST_NAME).read_text())["model"]
    kv, hd = model["num_kv_heads"] or model["num_heads"], model["head_dim"]
    edit_manifest(copy, lambda d: d["model"].update(head_dim=hd - 1))
    with pytest.raises(ArtifactError, match=re.escape(f"layer_00's past_key has dims ['batch', {kv}, {hd}, "
                                                      f"'past_sequence'], but the model entry says past_key "
                                                      f"sizes [{kv}, {hd - 1}]")):
        runtime.load(copy)

    def everywhere(d):  # edited consistently in the manifest: the graph file itself still differs
        for g in d["graphs"][1:-1]:
            for t in g["inputs"] + g["outputs"]:
                t["dims"] = [hd - 1 if x == hd else x for x in t["dims"]]

    edit_manifest(copy, everywhere)
    with pytest.raises(ArtifactError, match=re.escape(
            f"layer_00.onnx's past_key has dims ['batch', {kv}, {hd}, 'past_sequence'], but the manifest says "
            f"['batch', {kv}, {hd - 1}, 'past_sequence']: graph and manifest come from different exports")):
        runtime.load(copy)


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


_SPIN_SCRIPT = """
import json, sys, warnings
import runtime
art = sys.argv[1]
def pools(g):
    return sorted({str(s.get_session_options().use_per_session_threads) for s in g.backend._sessions.values()})
def run(name, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with runtime.load(art, check_hashes=False, max_batch=1, **options) as g:
            out[name] = [pools(g), g.generate("Hello, my name is", 8, ignore_eos=True).token_ids,
                         [str(w.message) for w in caught]]
out = {}
with runtime.load(art, check_hashes=False, max_batch=1, threads=2) as before:
    run("sleeping", threads=2)
    run("shared", threads=2, spin=True)
    run("later", threads=2)
    run("resized", threads=1, spin=True)
    out["before"] = [pools(before), before.generate("Hello, my name is", 8, ignore_eos=True).token_ids]
print(json.dumps(out))
"""


def test_spin_runs_every_graph_on_one_shared_pool_and_changes_no_token(artifact_dir):
    """spin=True: the graphs' sessions run on ONE spinning pool, the process's: the first spin=True
    load makes it at its threads, and ONNX Runtime then allows no session a pool of its own, so
    every later load shares it, with a warning that says so. Sessions made before keep theirs.
    A fresh process: the pool is once per process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SPIN_SCRIPT, str(artifact_dir)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    plain = out["sleeping"][1]
    assert out["sleeping"][0] == ["True"] and out["sleeping"][2] == []
    assert out["shared"][0] == ["False"] and out["shared"][2] == []
    for name, spin, threads in (("later", False, 2), ("resized", True, 1)):
        assert out[name][0] == ["False"]
        assert out[name][2] == [f"spin={spin}, threads={threads}: this process's ONNX Runtime sessions all run "
                                f"on the spinning pool of threads=2 that its first spin=True load made (ONNX "
                                f"Runtime allows no other pool beside it, nor a new size); load with "
                                f"spin=True in a process of its own for other settings"]
    assert out["before"][0] == ["True"]
    assert plain == out["shared"][1] == out["later"][1] == out["resized"][1] == out["before"][1]


def test_spin_without_the_shared_pool_spins_each_graph_briefly(artifact_dir, monkeypatch):
    from runtime.backends import onnxruntime as backend

    monkeypatch.setattr(backend, "_make_shared_pool", lambda threads: False)  # an ONNX Runtime without it
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


def test_a_backend_option_the_backend_does_not_take_is_named_with_those_it_takes(artifact_dir):
    """Each backend declares its options once, in its constructor; runtime.load and runtime.generate
    check against them (was: a TypeError from the constructor, or an option silently dropped)."""
    with pytest.raises(InvalidArgumentError, match="backend 'torch' takes the options device, cuda_graphs, "
                                                   "threads, compile_steps, int4_kernel; spin is not among them"):
        runtime.load(artifact_dir, backend="torch", spin=True)
    with pytest.raises(InvalidArgumentError, match="backend 'onnxruntime' takes the options providers, threads, "
                                                   "spin, huge_pages, fused, int4_kernel, deterministic, device; "
                                                   "bogus is not among them"):
        runtime.generate(artifact_dir, "Hello", 2, bogus=1)
