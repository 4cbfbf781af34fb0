"""tools.trtexec: command lines from a real export, version-dependent flags, trtexec JSON parsing, --run.

No TensorRT and no GPU: --run is exercised with a fake ``trtexec`` script that prints trtexec's banner
and copies the samples in data/ to the paths given by --exportTimes/--exportProfile. The samples follow
trtexec's own writer, NVIDIA/TensorRT samples/common/sampleReporting.cpp (exportJSONTrace,
Profiler::exportJSONProfile); see data/README.md.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.artifact.manifest import load_manifest
from tools.trtexec import (Limits, PrecisionError, ProfileLimitError, TrtexecError, TrtexecNotFoundError,
                           TrtexecOutputError, TrtVersion, detect_version, parse_banner, parse_size_mib,
                           precision_flags, read_profile, read_times, resolve_profile, workspace_flag)
from tools.trtexec import run as run_mod, version as version_mod
from tools.trtexec.cli import main
from tools.trtexec.report import GraphResult, latency_table, markdown_report, percentile
from tools.trtexec.shapes import shape_spec

DATA = Path(__file__).parent / "data"
V = TrtVersion.parse


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture
def no_trtexec(tmp_path, monkeypatch):
    """No trtexec anywhere and no tensorrt module: the tool must not find one on this machine either."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(run_mod, "KNOWN_LOCATIONS", ())
    monkeypatch.setattr(version_mod, "python_tensorrt_version", lambda: None)


FAKE_TRTEXEC = """#!{python}
import json, os, shutil, sys
from pathlib import Path

DATA = Path({data!r})
print("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] [b17] # trtexec " + " ".join(sys.argv[1:]))
if sys.argv[1:] == ["--help"]:
    sys.exit(0)
with open(os.environ["FAKE_TRTEXEC_ARGV"], "a") as f:
    f.write(json.dumps(sys.argv) + "\\n")
if os.environ.get("FAKE_TRTEXEC_FAIL"):
    print("[E] Error[4]: [network.cpp::validate::3000] Error Code 4: Internal Error (past_key: bad dims)")
    print("&&&& FAILED TensorRT.trtexec [TensorRT v100300] [b17]")
    sys.exit(1)
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
graph = Path(args["onnx"]).stem
sample = graph if (DATA / (graph + ".times.json")).exists() else "layer_03"
shutil.copy(DATA / (sample + ".times.json"), args["exportTimes"])
shutil.copy(DATA / (sample + ".profile.json"), args["exportProfile"])
print("&&&& PASSED TensorRT.trtexec [TensorRT v100300] [b17]")
"""


@pytest.fixture
def fake_trtexec(tmp_path, monkeypatch):
    """A `trtexec` on PATH; returns the file where it appends each argv it was run with."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    exe = bin_dir / "trtexec"
    exe.write_text(FAKE_TRTEXEC.format(python=sys.executable, data=str(DATA)))
    exe.chmod(0o755)
    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_TRTEXEC_ARGV", str(argv_log))
    monkeypatch.setattr(run_mod, "KNOWN_LOCATIONS", ())
    return argv_log


def _run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- version-dependent flags (pure) -------------------------------------------------------------------


@pytest.mark.parametrize("version, dtype, fp16, flags", [
    ("8.6", "float16", False, ("--fp16",)),  # no --stronglyTyped before 10
    ("8.6", "float32", False, ()),
    ("8.6", "float32", True, ("--fp16",)),
    ("10.3", "float16", False, ("--stronglyTyped",)),
    ("10.3", "float16", True, ("--stronglyTyped",)),  # never with --fp16: trtexec refuses the mix
    ("10.3", "float32", False, ()),
    ("10.3", "float32", True, ("--fp16",)),
    ("10.13", "float32", True, ("--fp16",)),
    ("11.0", "float16", False, ()),  # always strongly typed; precision flags removed
    ("11.0", "float32", False, ()),
])
def test_precision_flags(version, dtype, fp16, flags):
    assert precision_flags(V(version), dtype, fp16).flags == flags


def test_precision_flags_explain_deprecation_and_removal():
    assert "deprecated since TensorRT 10.12" in precision_flags(V("10.13"), "float32", True).reason
    assert "deprecated" not in precision_flags(V("10.3"), "float32", True).reason
    with pytest.raises(PrecisionError, match=r"TensorRT 11.0.0 removed.*--dtype fp16"):
        precision_flags(V("11.0"), "float32", True)
    with pytest.raises(PrecisionError, match="bfloat16"):
        precision_flags(V("10.3"), "bfloat16")


def test_workspace_flag_by_version():
    assert workspace_flag(V("8.6"), 2048) == "--memPoolSize=workspace:2048"
    assert workspace_flag(V("10.3"), 512) == "--memPoolSize=workspace:512"
    assert workspace_flag(V("8.2.1"), 1024) == "--workspace=1024"  # before setMemoryPoolLimit (8.4)


def test_version_parsing_and_banner():
    assert V("10.3.0.26") == TrtVersion(10, 3, 0)
    assert V("8.6") == TrtVersion(8, 6, 0) and str(V("8.6")) == "8.6.0"
    assert V("8.6.1") < V("10.0") < V("10.12")
    with pytest.raises(TrtexecError, match="--trt-version 10.3"):
        V("latest")
    assert parse_banner("&&&& RUNNING TensorRT.trtexec [TensorRT v8601] # trtexec --help") == TrtVersion(8, 6, 1)
    assert parse_banner("&&&& RUNNING TensorRT.trtexec [TensorRT v100500] [b18] # x") == TrtVersion(10, 5, 0)
    assert parse_banner("&&&& RUNNING TensorRT.trtexec [TensorRT v101303] [b9]") == TrtVersion(10, 13, 3)
    assert parse_banner("command not found") is None


def test_detect_version_order(no_trtexec, fake_trtexec, monkeypatch):
    assert detect_version("8.6", None).version == TrtVersion(8, 6)  # explicit wins, nothing probed
    found = detect_version(None, run_mod.find_trtexec())
    assert found.version == TrtVersion(10, 3, 0) and "banner" in found.source and not found.assumed
    monkeypatch.setattr(version_mod, "python_tensorrt_version", lambda: TrtVersion(10, 8))
    assert detect_version(None, None).version == TrtVersion(10, 8)
    monkeypatch.setattr(version_mod, "python_tensorrt_version", lambda: None)
    assumed = detect_version(None, None)
    assert assumed.assumed and assumed.version == TrtVersion(10, 3) and "--trt-version" in assumed.source


@pytest.mark.parametrize("text, mib", [("2GiB", 2048), ("512MiB", 512), ("1024", 1024), ("0.5G", 512),
                                       ("3 gb", 3072)])
def test_parse_size_mib(text, mib):
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize("text", ["lots", "512K", "-1G"])
def test_parse_size_mib_rejects(text):
    with pytest.raises(TrtexecError, match="2GiB"):
        parse_size_mib(text)


# -- profiles (pure) ----------------------------------------------------------------------------------


def _dims(b, s, p, width):
    """A profile point, pages of 32: past in positions, the width of the past bound (one page for
    an empty past, else whole pages that hold the past and the new positions)."""
    return {"batch": b, "sequence": s, "past": p, "past_sequence": width, "page_size": 32}


def test_decode_profile():
    prof = resolve_profile(Limits(batch=4, past=256, max_batch=8, max_seq=1024), 2048, 32)
    assert prof.phase == "decode"
    assert prof.min == _dims(1, 1, 0, 32)  # a decode step binds at least one page
    assert prof.opt == prof.run == _dims(4, 1, 256, 288)  # position 256 is written in a ninth page
    assert prof.max == _dims(8, 1, 1023, 1024)
    assert resolve_profile(Limits(batch=2, past=5), 64, 32).max == _dims(2, 1, 63, 64)  # max_seq: the model's
    assert resolve_profile(Limits(past=33), 64, 32).run == _dims(1, 1, 33, 64)  # a partial page is bound whole
    assert resolve_profile(Limits(past=31), 64, 32).run == _dims(1, 1, 31, 32)  # the new position fits the page
    assert resolve_profile(Limits(past=32), 64, 32).run == _dims(1, 1, 32, 64)  # ... or needs the next one


def test_prefill_profile():
    prof = resolve_profile(Limits(batch=2, sequence=100, max_seq=1024, max_prompt=512), 2048, 32)
    assert prof.phase == "prefill"
    # the prompt into fresh rows: one page of zeros, all masked, whatever its length
    assert (prof.min, prof.opt, prof.max) == (_dims(1, 1, 0, 32), _dims(2, 100, 0, 32), _dims(2, 512, 0, 32))
    assert resolve_profile(Limits(sequence=1, phase="prefill"), 64, 32).max == _dims(1, 64, 0, 32)


@pytest.mark.parametrize("limits, message", [
    (Limits(batch=4, past=256), r"past 256 \+ sequence 1 = 257 positions exceed max_seq 64; use --past 63"),
    (Limits(past=10, max_seq=128), r"--max-seq 128 is outside 1..64.*--max-seq 64"),
    (Limits(batch=4, max_batch=2), r"--batch 4 exceeds --max-batch 2; raise --max-batch to at least 4"),
    (Limits(sequence=8, phase="decode"), r"decode profile runs 1 token.*--phase prefill"),
    (Limits(sequence=8, past=4), r"prefill profile starts from an empty KV cache.*--past 0"),
    (Limits(sequence=40, max_prompt=32), r"--seq 40 exceeds --max-prompt 32"),
    (Limits(batch=0), r"batch and sequence must be >= 1"),
])
def test_profile_limits_state_limit_and_fix(limits, message):
    with pytest.raises(ProfileLimitError, match=message):
        resolve_profile(limits, 64, 32)


# -- command lines from a real export ------------------------------------------------------------------
# The tiny test model: hidden 32, 4 heads of 8, 6 layers, 64 positions (tests/conftest.py).


def _expected(artifact_dir, graph, min_s, opt_s, max_s, *middle, transfers=True, out=None):
    out = Path(out) if out else artifact_dir / "trtexec"
    cmd = ["trtexec", f"--onnx={artifact_dir / (graph + '.onnx')}", f"--minShapes={min_s}",
           f"--optShapes={opt_s}", f"--maxShapes={max_s}", f"--shapes={opt_s}", *middle,
           "--warmUp=500", "--duration=5", "--iterations=100"]
    if not transfers:
        cmd.append("--noDataTransfers")
    return shlex.join(cmd + ["--separateProfileRun", f"--exportTimes={out / (graph + '.times.json')}",
                             f"--exportProfile={out / (graph + '.profile.json')}"])


def _cache(artifact_dir):
    return f"--timingCacheFile={artifact_dir / 'trtexec' / 'timing.cache'}"


def test_layer_command(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_03", "--batch", 4, "--past", 20,
                              "--trt-version", "10.3")
    assert code == 0, err
    assert out.splitlines() == [_expected(
        artifact_dir, "layer_03",
        "hidden_states:1x1x32,attention_mask:1x33,past_key:1x4x8x32,past_value:1x4x32x8",
        "hidden_states:4x1x32,attention_mask:4x33,past_key:4x4x8x32,past_value:4x4x32x8",
        "hidden_states:4x1x32,attention_mask:4x65,past_key:4x4x8x64,past_value:4x4x64x8",
        "--memPoolSize=workspace:2048", _cache(artifact_dir), transfers=False)]
    assert "# TensorRT 10.3.0 (--trt-version)" in err
    assert ("decode profile: batch 1..4 (run 4), sequence 1..1 (run 1), past 0..63 (run 20), bound past "
            "width 32..64 in pages of 32 (run 32)") in err


def test_embed_and_head_commands(artifact_dir, no_trtexec, capsys, tmp_path):
    common = ["--batch", 4, "--past", 32, "--trt-version", "8.6", "--fp16", "--max-batch", 8,
              "--engine-dir", tmp_path / "engines", "--workspace", "1GiB"]
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "embed", *common)
    assert code == 0, err
    assert out.splitlines() == [_expected(
        artifact_dir, "embed", "input_ids:1x1,attention_mask:1x33", "input_ids:4x1,attention_mask:4x65",
        "input_ids:8x1,attention_mask:8x65", "--fp16", "--memPoolSize=workspace:1024", _cache(artifact_dir),
        f"--saveEngine={tmp_path / 'engines' / 'embed.plan'}")]
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "head", *common)
    assert out.splitlines() == [_expected(
        artifact_dir, "head", "hidden_states:1x1x32", "hidden_states:4x1x32", "hidden_states:8x1x32",
        "--fp16", "--memPoolSize=workspace:1024", _cache(artifact_dir),
        f"--saveEngine={tmp_path / 'engines' / 'head.plan'}")]


def test_prefill_layer_command(artifact_dir, no_trtexec, capsys, tmp_path):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_00", "--batch", 2, "--seq", 16,
                              "--max-prompt", 48, "--trt-version", "10.3", "--out", tmp_path / "o")
    assert code == 0, err
    assert out.splitlines() == [_expected(
        artifact_dir, "layer_00",
        "hidden_states:1x1x32,attention_mask:1x33,past_key:1x4x8x32,past_value:1x4x32x8",
        "hidden_states:2x16x32,attention_mask:2x48,past_key:2x4x8x32,past_value:2x4x32x8",
        "hidden_states:2x48x32,attention_mask:2x80,past_key:2x4x8x32,past_value:2x4x32x8",
        "--memPoolSize=workspace:2048", f"--timingCacheFile={tmp_path / 'o' / 'timing.cache'}",
        transfers=False, out=tmp_path / "o")]


def test_all_prints_every_graph_with_one_timing_cache(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--all", "--batch", 2, "--past", 8, "--trt-version", "10.3")
    assert code == 0, err
    lines = out.splitlines()
    assert [shlex.split(line)[1] for line in lines] == [
        f"--onnx={artifact_dir / name}.onnx" for name in ["embed", *(f"layer_{i:02d}" for i in range(6)), "head"]]
    assert all(_cache(artifact_dir) in shlex.split(line) for line in lines)


def test_fp16_artifact_is_strongly_typed_on_10x(artifact_dir, no_trtexec, capsys, tmp_path):
    fp16 = tmp_path / "fp16-artifact"
    shutil.copytree(artifact_dir, fp16)
    manifest = json.loads((fp16 / "manifest.json").read_text())
    manifest["dtype"] = "float16"  # the flag choice reads only the manifest's dtype
    (fp16 / "manifest.json").write_text(json.dumps(manifest))
    for version, flag, absent in [("10.3", "--stronglyTyped", "--fp16"), ("8.6", "--fp16", "--stronglyTyped")]:
        code, out, err = _run_cli(capsys, fp16, "--graph", "layer_01", "--trt-version", version, "--fp16")
        argv = shlex.split(out)
        assert code == 0 and flag in argv and absent not in argv, err
    code, out, err = _run_cli(capsys, fp16, "--graph", "layer_01", "--trt-version", "11.1")
    assert code == 0 and not {"--fp16", "--stronglyTyped"} & set(shlex.split(out))


def test_assumed_version_is_printed(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "head")
    assert code == 0
    assert "# TensorRT 10.3.0 (assumed: no trtexec and no tensorrt module found" in err
    assert "--memPoolSize=workspace:2048" in out


def test_unknown_graph_lists_available(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_99", "--trt-version", "10.3")
    assert code == 2 and out == ""
    assert "has no graph 'layer_99'; available: embed, layer_00, layer_01, layer_02, layer_03, layer_04, " \
           "layer_05, head" in err


def test_limit_error_from_cli(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_03", "--batch", 4, "--past", 256,
                              "--trt-version", "10.3")
    assert code == 2 and out == ""
    assert "error: past 256 + sequence 1 = 257 positions exceed max_seq 64; use --past 63 or less" in err


def test_module_entry_point(artifact_dir):
    done = subprocess.run([sys.executable, "-m", "tools.trtexec", str(artifact_dir), "--graph", "layer_02",
                           "--trt-version", "10.3", "--trtexec", "/opt/trt/bin/trtexec"],
                          capture_output=True, text=True, cwd=Path(__file__).parents[2], check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"/opt/trt/bin/trtexec --onnx={artifact_dir / 'layer_02.onnx'} --minShapes=")


# -- parsing trtexec's JSON ---------------------------------------------------------------------------


def test_read_times_current_layout():
    t = read_times(DATA / "layer_03.times.json", warmup_ms=500)
    assert t.queries == 20
    assert (t.median_ms, t.p90_ms, t.p99_ms, t.min_ms, t.max_ms) == (0.5105, 0.545, 0.602, 0.498, 0.602)
    assert t.mean_ms == pytest.approx(0.51875)
    assert t.compute_median_ms == 0.5105  # --noDataTransfers: latency is compute
    assert t.throughput_qps == pytest.approx(20 / 11.325 * 1000)


def test_read_times_older_layout_drops_warmup():
    t = read_times(DATA / "head.times.json", warmup_ms=500)
    assert t.queries == 8  # the 3 warm-up queries compute before 500 ms
    assert (t.median_ms, t.p90_ms, t.p99_ms) == (0.3595, 0.367, 0.367)
    assert t.mean_ms == pytest.approx(0.36)
    assert t.compute_median_ms == pytest.approx(0.3025)
    assert t.throughput_qps == pytest.approx(8 / (503.309 - 500.072) * 1000)
    assert read_times(DATA / "head.times.json", warmup_ms=0).queries == 11


def test_percentile_matches_trtexec_float32():
    # trtexec: exclude = int((1 - 90/100.f) * 20) = int(2.0000005) = 2 -> index 17 (float64 would give 18)
    assert percentile(list(range(20)), 90) == 17
    assert percentile(list(range(20)), 99) == 19
    assert percentile([1.0], 50) == 1.0


def test_read_profile():
    count, layers = read_profile(DATA / "layer_03.profile.json")
    assert count == 120 and len(layers) == 9
    assert layers[0].name == "{ForeignNode[/Concat_3.../Reshape_5]}"
    assert (layers[0].average_ms, layers[0].median_ms, layers[0].percentage) == (0.124, 0.1236, 24.7012)
    assert [x.average_ms for x in layers] == sorted((x.average_ms for x in layers), reverse=True)
    count, layers = read_profile(DATA / "head.profile.json")
    assert count == 80 and layers[0].name == "/lm_head/MatMul" and layers[0].median_ms is None


def test_malformed_outputs_raise_typed_errors(tmp_path):
    with pytest.raises(TrtexecOutputError, match="wrote no --exportTimes file.*log"):
        read_times(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[ { \"startEnqMs\" : 1")
    with pytest.raises(TrtexecOutputError, match="not valid JSON"):
        read_times(bad)
    bad.write_text('[{"name": "x"}]')
    with pytest.raises(TrtexecOutputError, match="count"):
        read_profile(bad)
    with pytest.raises(TrtexecOutputError, match="lacks startComputeMs"):
        read_times(bad)
    with pytest.raises(TrtexecOutputError, match="warm-up"):
        read_times(DATA / "layer_03.times.json", warmup_ms=10_000)


def _result(graph, times, profile, warmup=500):
    count, layers = read_profile(DATA / profile)
    return GraphResult(graph, "decode", 4, 1, 32, read_times(DATA / times, warmup), layers, count)


def test_markdown_table_known_numbers():
    layer = _result("layer_03", "layer_03.times.json", "layer_03.profile.json")
    head = _result("head", "head.times.json", "head.profile.json")
    lines = latency_table([layer, head]).splitlines()
    assert lines[0] == ("| graph | phase | batch | seq | past | queries | median ms | mean ms | p90 ms | p99 ms "
                        "| GPU median ms | queries/s | tokens/s |")
    assert lines[1] == "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    assert lines[2] == ("| layer_03 | decode | 4 | 1 | 32 | 20 | 0.5105 | 0.5188 | 0.5450 | 0.6020 | 0.5105 "
                        "| 1766.0 | 7064.0 |")
    assert lines[3] == ("| head | decode | 4 | 1 | 32 | 8 | 0.3595 | 0.3600 | 0.3670 | 0.3670 | 0.3025 "
                        "| 2471.4 | 9885.7 |")
    assert lines[4] == "| **sum** |  |  |  |  |  | 0.8700 | 0.8788 |  |  | 0.8130 |  |  |"
    report = markdown_report([layer, head], top=2)
    assert "#### layer_03: slowest TensorRT layers (120 profiled iterations)" in report
    assert "| {ForeignNode[/Concat_3.../Reshape_5]} | 0.1240 | 0.1236 | 24.7 |" in report
    assert "| /lm_head/MatMul | 0.2750 | - | 94.8 |" in report
    assert "| /LayerNormalization |" not in report  # only the top 2 per graph
    assert "####" not in markdown_report([layer], top=0)


# -- --run ----------------------------------------------------------------------------------------------


def test_run_without_trtexec_says_where_to_get_it(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_03", "--run", "--trt-version", "10.3")
    assert code == 2 and out == ""
    assert "--run needs NVIDIA's trtexec, which is not on PATH" in err
    assert "/usr/src/tensorrt/bin/trtexec" in err and "--trtexec /path/to/trtexec" in err
    with pytest.raises(TrtexecNotFoundError, match="not an executable file"):
        run_mod.require_trtexec(str(artifact_dir / "manifest.json"))


def test_run_end_to_end_with_fake_trtexec(artifact_dir, fake_trtexec, capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_03", "--batch", 4, "--past", 32, "--run",
                              "--out", out_dir)
    assert code == 0, err
    assert "# TensorRT 10.3.0 (banner of " in err  # probed from the fake's banner, not assumed
    ran = [json.loads(line) for line in fake_trtexec.read_text().splitlines()]
    assert len(ran) == 1
    assert f"$ {shlex.join(ran[0])}" in err  # what ran is what was printed
    assert f"--exportTimes={out_dir / 'layer_03.times.json'}" in ran[0] and "--noDataTransfers" in ran[0]
    assert ("| layer_03 | decode | 4 | 1 | 32 | 20 | 0.5105 | 0.5188 | 0.5450 | 0.6020 | 0.5105 | 1766.0 "
            "| 7064.0 |") in out
    assert "| {ForeignNode[/Concat_3.../Reshape_5]} | 0.1240 | 0.1236 | 24.7 |" in out
    assert "PASSED" in (out_dir / "layer_03.log").read_text()


def test_run_all_sweeps_into_one_table(artifact_dir, fake_trtexec, capsys, tmp_path):
    code, out, err = _run_cli(capsys, artifact_dir, "--all", "--batch", 4, "--past", 32, "--run",
                              "--out", tmp_path / "out", "--top", 0)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| graph")]
    names = [r.split(" | ")[0][2:] for r in rows]
    assert names == ["embed", *(f"layer_{i:02d}" for i in range(6)), "head", "**sum**"]
    # embed and the layers reuse the layer_03 sample (median 0.5105), head its own (0.3595)
    assert rows[-1].startswith(f"| **sum** |  |  |  |  |  | {7 * 0.5105 + 0.3595:.4f} |")
    assert len(fake_trtexec.read_text().splitlines()) == 8
    assert "####" not in out


def test_run_failure_quotes_the_log(artifact_dir, fake_trtexec, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRTEXEC_FAIL", "1")
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "head", "--run", "--out", tmp_path / "out")
    assert code == 2 and out == ""
    assert "trtexec exited with status 1" in err
    assert "Error Code 4: Internal Error" in err and str(tmp_path / "out" / "head.log") in err


def test_shape_spec_embed_mask_follows_the_runtime(artifact_dir):
    """The embedding gets the layers' mask, the bound past (whole pages) + the new positions, at
    prefill (one all-masked page) and at decode, as the runtime passes it."""
    manifest = load_manifest(artifact_dir, check_hashes=False)
    prefill = resolve_profile(Limits(batch=2, sequence=16), 64, manifest.page_size)
    decode = resolve_profile(Limits(batch=2, past=40), 64, manifest.page_size)
    assert shape_spec(manifest.embed, prefill.run) == "input_ids:2x16,attention_mask:2x48"
    assert shape_spec(manifest.layers[0], prefill.run) == (
        "hidden_states:2x16x32,attention_mask:2x48,past_key:2x4x8x32,past_value:2x4x32x8")
    assert shape_spec(manifest.embed, decode.run) == "input_ids:2x1,attention_mask:2x65"
    assert shape_spec(manifest.layers[0], decode.run) == (
        "hidden_states:2x1x32,attention_mask:2x65,past_key:2x4x8x64,past_value:2x4x64x8")


# -- the Polygraphy comparison beside each command ----------------------------------------------------
# Flags as Polygraphy's argument groups define them (tools/Polygraphy/polygraphy/tools/args in
# NVIDIA/TensorRT): runner selection, ModelArgs, TrtConfigArgs, TrtLoadNetworkArgs, OnnxLoadArgs,
# DataLoaderArgs, CompareFuncSimpleArgs. The generated command may use no other.
POLYGRAPHY_FLAGS = {"--onnxrt", "--trt", "--input-shapes", "--trt-min-shapes", "--trt-opt-shapes",
                    "--trt-max-shapes", "--tf32", "--fp16", "--strongly-typed", "--pool-limit", "--val-range",
                    "--onnx-outputs", "--trt-outputs", "--atol", "--rtol"}


def test_the_polygraphy_flags_are_the_installed_polygraphys():
    """Every flag the generated commands may use is one `polygraphy run --help` lists (the installed
    Polygraphy, which the export extra installs), so a renamed or removed flag fails here."""
    exe = shutil.which("polygraphy")
    if exe is None:
        pytest.fail("polygraphy is not on the PATH: pip install -e '.[export]' installs it")
    done = subprocess.run([exe, "run", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))
    assert sorted(POLYGRAPHY_FLAGS - listed) == []


def _polygraphy_args(line: str) -> dict[str, list[str]]:
    """``polygraphy run MODEL --flag v1 v2 --other ...`` -> {"model": [MODEL], "--flag": [v1, v2], ...}."""
    argv = shlex.split(line)
    assert argv[:2] == ["polygraphy", "run"], line
    args, key = {"model": [argv[2]]}, None
    for a in argv[3:]:
        if a.startswith("--"):
            assert a not in args, f"{a} given twice"
            key = a
            args[key] = []
        else:
            args[key].append(a)
    return args


def _as_polygraphy(trtexec_spec: str) -> list[str]:
    """trtexec's ``a:1x2,b:3`` -> Polygraphy's ``["a:[1,2]", "b:[3]"]``."""
    return [f"{name}:[{dims.replace('x', ',')}]" for name, dims in (s.split(":") for s in trtexec_spec.split(","))]


def test_polygraphy_layer_command_matches_the_trtexec_profile(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "layer_03", "--batch", 4, "--past", 32,
                              "--trt-version", "10.3", "--polygraphy")
    assert code == 0, err
    trtexec_line, polygraphy_line = out.splitlines()
    trt = dict(a[2:].split("=", 1) for a in shlex.split(trtexec_line)[1:] if "=" in a)
    args = _polygraphy_args(polygraphy_line)
    assert set(args) - {"model"} <= POLYGRAPHY_FLAGS
    assert args["model"] == [str(artifact_dir / "layer_03.onnx")]
    assert args["--onnxrt"] == args["--trt"] == []
    for ours, theirs in [("--trt-min-shapes", "minShapes"), ("--trt-opt-shapes", "optShapes"),
                         ("--trt-max-shapes", "maxShapes"), ("--input-shapes", "shapes")]:
        assert args[ours] == _as_polygraphy(trt[theirs])
    assert args["--trt-max-shapes"] == ["hidden_states:[4,1,32]", "attention_mask:[4,65]",
                                        "past_key:[4,4,8,64]", "past_value:[4,4,64,8]"]
    # fp32 artifact: the engines build with TF32 (TensorRT's default); Polygraphy needs it asked for
    assert args["--tf32"] == [] and "--fp16" not in args and "--strongly-typed" not in args
    assert args["--pool-limit"] == ["workspace:2048M"]
    assert args["--val-range"] == ["attention_mask:[1,1]"]  # no ids in a layer; an all-ones mask
    assert args["--atol"] == ["0.03"] and args["--rtol"] == ["0.03"]
    assert "--onnx-outputs" not in args
    assert "# polygraphy: --tf32, atol 0.03 rtol 0.03" in err


def test_polygraphy_embed_ids_in_vocabulary_and_layerwise(artifact_dir, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "embed", "--trt-version", "8.6", "--fp16",
                              "--workspace", "1GiB", "--layerwise")
    assert code == 0, err
    args = _polygraphy_args(out.splitlines()[1])
    vocab = load_manifest(artifact_dir, check_hashes=False).model.vocab_size
    assert args["--val-range"] == [f"input_ids:[0,{vocab - 1}]", "attention_mask:[1,1]"]
    assert args["--fp16"] == [] and args["--pool-limit"] == ["workspace:1024M"]
    assert args["--onnx-outputs"] == args["--trt-outputs"] == ["mark", "all"]


def test_polygraphy_fp16_artifact_precision_by_version(artifact_dir, no_trtexec, capsys, tmp_path):
    fp16 = tmp_path / "fp16-artifact"
    shutil.copytree(artifact_dir, fp16)
    manifest = json.loads((fp16 / "manifest.json").read_text())
    manifest["dtype"] = "float16"
    (fp16 / "manifest.json").write_text(json.dumps(manifest))
    for version, flag in [("8.6", "--fp16"), ("10.3", "--strongly-typed"), ("11.1", "--strongly-typed")]:
        code, out, err = _run_cli(capsys, fp16, "--graph", "head", "--trt-version", version, "--polygraphy")
        args = _polygraphy_args(out.splitlines()[1])
        assert code == 0 and flag in args, (version, err)
        assert not {"--fp16", "--strongly-typed", "--tf32"} - {flag} & set(args)
        assert "--val-range" not in args  # the head has only float inputs


def test_polygraphy_for_all_graphs_and_with_run(artifact_dir, no_trtexec, fake_trtexec, capsys):
    code, out, err = _run_cli(capsys, artifact_dir, "--all", "--trt-version", "10.3", "--polygraphy")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2 * 8
    assert [Path(shlex.split(line)[0]).name for line in lines] == ["trtexec", "polygraphy"] * 8
    assert [shlex.split(line)[2] for line in lines[1::2]] == [
        str(artifact_dir / f"{n}.onnx") for n in ["embed", *(f"layer_{i:02d}" for i in range(6)), "head"]]
    code, out, err = _run_cli(capsys, artifact_dir, "--graph", "head", "--run", "--polygraphy")
    assert code == 0 and "polygraphy" not in out  # the table stays clean; the check goes to stderr
    assert f"# accuracy: polygraphy run {artifact_dir / 'head.onnx'} --onnxrt --trt" in err


def test_polygraphy_tolerance_is_the_exports_fp16_tolerance():
    from export.parity import TOLERANCES
    from tools.trtexec.polygraphy import TOLERANCE

    assert TOLERANCE == TOLERANCES["float16"]


# -- graphs the target TensorRT cannot parse ----------------------------------------------------------


@pytest.fixture(scope="module")
def int4_artifacts(tmp_path_factory):
    """One pre-LN tiny model exported int4 twice: as MatMulNBits and as blocked DequantizeLinear."""
    from export.build import BuildOptions, build
    from tests.conftest import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("trtexec-int4")
    ckpt = save_tiny_checkpoint(root / "ckpt", "pre_ln")
    out = {}
    for fmt in ("matmulnbits", "qdq"):
        out[fmt] = root / fmt
        build(BuildOptions(model=str(ckpt), out=str(out[fmt]), weights="int4", weights_format=fmt, block_size=16,
                           check=False, progress=False), log=lambda *_: None)
    return out


def test_matmulnbits_graph_is_refused_with_the_reason(int4_artifacts, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, int4_artifacts["matmulnbits"], "--graph", "layer_00", "--trt-version", "10.3")
    assert code == 2 and out == ""
    [line, *reasons] = err.strip().splitlines()
    assert line == ("error: TensorRT 10.3's ONNX parser cannot import layer_00 (checked against TensorRT 10.3's "
                    "operator list):")
    assert reasons and all(r.startswith("  layer_00: ") for r in reasons)
    assert "com.microsoft::MatMulNBits is not an ONNX operator" in reasons[0]
    assert "--quant-format qdq" in reasons[0]
    # a version without its own data is checked against the nearest older one, and says so
    code, out, err = _run_cli(capsys, int4_artifacts["matmulnbits"], "--all", "--trt-version", "10.8.0")
    assert code == 2 and "cannot import layer_00, layer_01" in err
    assert "(checked against TensorRT 10.3's operator list, the nearest known to 10.8)" in err
    assert "embed" not in err.splitlines()[0]  # the float embedding parses


def test_qdq_graph_warns_on_10_3_and_is_refused_on_8_6(int4_artifacts, no_trtexec, capsys):
    code, out, err = _run_cli(capsys, int4_artifacts["qdq"], "--graph", "layer_00", "--trt-version", "10.3")
    assert code == 0 and out.startswith("trtexec ")
    assert "# warning (TensorRT 10.3): layer_00: opset 21 is past the parser's documented range" in err
    code, out, err = _run_cli(capsys, int4_artifacts["qdq"], "--graph", "layer_00", "--trt-version", "8.6")
    assert code == 2 and out == ""
    assert "DequantizeLinear on INT4: this parser has no INT4" in err
    code, out, err = _run_cli(capsys, int4_artifacts["qdq"], "--graph", "layer_00", "--trt-version", "11.0")
    assert code == 0 and "# warning" not in err
