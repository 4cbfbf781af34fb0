"""``python -m tools.bench.board``: this toolkit's rows beside llama-bench's and TensorRT Edge-LLM's
llm_bench's, with tegrastats' memory and watts per row (a fake tegrastats, llama-bench and llm_bench
stand in for a board's)."""

from __future__ import annotations

import json
import stat
import sys

import pytest

from tools.bench import board

# tegrastats lines as modules print them (public captures: an Orin Nano on JetPack 6, an AGX Orin, a Thor)
ORIN_NANO = ("11-29-2026 01:12:00 RAM 2345/7620MB (lfb 4x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@729,0%@729] "
             "GR3D_FREQ 0% cpu@45.5C soc2@44.2C tj@46C VDD_IN 4720mW/4690mW VDD_CPU_GPU_CV 594mW/580mW "
             "VDD_SOC 1346mW/1340mW")
AGX_ORIN = ("RAM 5012/62841MB (lfb 9x4MB) CPU [1%@1190] GR3D_FREQ 0% VDD_GPU_SOC 2780mW/2780mW "
            "VDD_CPU_CV 396mW/396mW VIN_SYS_5V0 3520mW/3520mW")
THOR = "RAM 9120/125772MB CPU [3%@2601] GPC_FREQ 1575MHz VDD_GPU 8123mW/8000mW VIN 31500mW/31000mW"


@pytest.mark.parametrize("line, ram, rail, mw", [(ORIN_NANO, 2345, "VDD_IN", 4720), (AGX_ORIN, 5012, "VIN_SYS_5V0", 3520),
                                                  (THOR, 9120, "VIN", 31500)])
def test_a_tegrastats_line_gives_ram_and_each_rails_current_power(line, ram, rail, mw):
    sample = board.parse_line(line)
    assert sample.ram_mb == ram and sample.rails[rail] == mw
    assert board.rail_of([sample], None) == rail  # the module's input rail


def _script(path, body: str):
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


FAKE_TEGRASTATS = """
import sys, time
interval = int(sys.argv[sys.argv.index("--interval") + 1]) / 1000
n = 0
while True:
    used = 2000 if n < 3 else 2300  # idle first, then the model's 300 MB
    print(f"RAM {used}/7620MB (lfb 4x4MB) CPU [2%@729] VDD_IN 5000mW/5000mW VDD_SOC 1000mW/1000mW", flush=True)
    n += 1
    time.sleep(interval)
"""

FAKE_LLAMA_BENCH = """
import json, sys
a = sys.argv
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
assert a[a.index("-ngl") + 1] == "99" and a[a.index("-o") + 1] == "json" and a[a.index("-m") + 1].endswith(".gguf")
print(json.dumps([{"backends": "CUDA", "n_prompt": p, "n_gen": 0, "avg_ts": 812.5},
                  {"backends": "CUDA", "n_prompt": 0, "n_gen": n, "avg_ts": 97.25}]))
"""


def test_the_table_holds_our_rows_and_llama_bench_with_memory_and_watts(artifact_dir, tmp_path, capsys):
    tegrastats = _script(tmp_path / "tegrastats", FAKE_TEGRASTATS)
    bench = _script(tmp_path / "llama-bench", FAKE_LLAMA_BENCH)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "board.md"
    assert board.main([str(artifact_dir), "--speedups", "1", "2", "--prompt-tokens", "8", "--new-tokens", "6",
                       "--rounds", "2", "--tegrastats", str(tegrastats), "--interval", "20",
                       "--llama-bench", str(bench), "--gguf", str(gguf), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| skipdecode") or
            line.startswith("| llama.cpp")]
    assert [r[1] for r in rows] == ["onnxruntime, 1x", "onnxruntime, 2x", "CUDA, -ngl 99"]
    assert "watts (VDD_IN)" in text and "RAM used MB (tegrastats, over idle)" in text
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0
        assert r[4] == "300" and r[5] == "5.00"  # the fake's RAM over its idle value, VDD_IN's 5 W
        assert float(r[6].rstrip(" |")) == pytest.approx(5.0 / float(r[3]) * 1e3, rel=0.01, abs=0.06)  # mJ/token
    assert (rows[2][2], rows[2][3]) == ("812.5", "97.2")  # llama-bench's own averages


# llm_bench's summary as examples/utils/benchLogger.cpp prints it (through LOG_INFO): its E2E time
# and tokens/s, prefill = inputLen / E2E, decode = (osl - 1) / E2E
FAKE_LLM_BENCH = """
import sys
a = sys.argv
assert a[a.index("--batchSize") + 1] == "1" and a[a.index("--engineDir") + 1].endswith("engine")
mode = a[a.index("--mode") + 1]
print("[TensorRT-Edge-LLM][INFO] Loading engine ...", file=sys.stderr)
if mode == "prefill":
    n = int(a[a.index("--inputLen") + 1])
    print(f"[TensorRT-Edge-LLM][INFO] InputLen: {n}, ReuseKVLen: 0, ContextLen: {n}")
    print(f"[TensorRT-Edge-LLM][INFO] E2E Time (actual performance): 20.0000 ms")
    print(f"[TensorRT-Edge-LLM][INFO] Tokens/sec (E2E): {n * 1000 / 20.0:.1f}")
else:
    osl = int(a[a.index("--osl") + 1])
    print(f"[TensorRT-Edge-LLM][INFO] PastKVLen: {a[a.index('--pastKVLen') + 1]}, OSL: {osl}")
    print("[TensorRT-Edge-LLM][INFO] E2E Time (actual performance): 50.0000 ms")
    print(f"[TensorRT-Edge-LLM][INFO] Tokens/sec (E2E): {(osl - 1) * 1000 / 50.0:.1f}")
"""


def test_edge_llms_llm_bench_gives_a_row_of_its_own_tokens_per_second(artifact_dir, tmp_path, capsys):
    bench = _script(tmp_path / "llm_bench", FAKE_LLM_BENCH)
    (tmp_path / "engine").mkdir()
    assert board.main([str(artifact_dir), "--speedups", "1", "--prompt-tokens", "8", "--new-tokens", "6",
                       "--rounds", "1", "--tegrastats", "none", "--edgellm-bench", str(bench),
                       "--edgellm-engine", str(tmp_path / "engine")]) == 0
    (row,) = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| TensorRT")]
    assert row[1:4] == ["batch 1", "400.0", "100.0"]  # 8 tokens in 20 ms; 5 after the first in 50 ms
    assert float(row[4]) > 0  # its own peak RSS


def test_a_peer_that_fails_or_prints_nothing_readable_is_one_error(artifact_dir, tmp_path, capsys):
    (tmp_path / "engine").mkdir()
    common = [str(artifact_dir), "--speedups", "1", "--prompt-tokens", "4", "--new-tokens", "3", "--rounds", "1",
              "--tegrastats", "none", "--edgellm-engine", str(tmp_path / "engine")]
    failing = _script(tmp_path / "failing", "import sys; print('no engine here', file=sys.stderr); sys.exit(3)")
    assert board.main([*common, "--edgellm-bench", str(failing)]) == 2
    assert "error: llm_bench --mode prefill failed (exit 3)" in capsys.readouterr().err
    mute = _script(tmp_path / "mute", "print('done')")
    assert board.main([*common, "--edgellm-bench", str(mute)]) == 2
    assert "printed no 'Tokens/sec (E2E): N' line" in capsys.readouterr().err


def test_without_tegrastats_the_memory_is_peak_rss_and_no_watts(artifact_dir, capsys):
    assert board.main([str(artifact_dir), "--speedups", "1", "--prompt-tokens", "4", "--new-tokens", "3",
                       "--rounds", "1", "--tegrastats", "none"]) == 0
    text = capsys.readouterr().out
    (row,) = [line.split(" | ") for line in text.splitlines() if line.startswith("| skipdecode")]
    assert "peak RSS MB" in text and float(row[4]) > 0 and row[5] == "-"


def test_options_that_do_not_go_together_are_refused(artifact_dir, tmp_path, capsys):
    assert board.main([str(artifact_dir), "--llama-bench", "llama-bench"]) == 2
    assert capsys.readouterr().err == ("error: --llama-bench and --gguf go together: llama-bench needs the GGUF "
                                       "of the same model\n")
    assert board.main([str(artifact_dir), "--llama-bench", "x", "--gguf", str(tmp_path / "no.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert board.main([str(artifact_dir), "--edgellm-bench", "llm_bench"]) == 2
    assert "--edgellm-bench and --edgellm-engine go together" in capsys.readouterr().err
    assert board.main([str(artifact_dir), "--edgellm-bench", "x", "--edgellm-engine", str(tmp_path / "none")]) == 2
    assert "--edgellm-engine " + str(tmp_path / "none") + ": no such directory" in capsys.readouterr().err
    silent = _script(tmp_path / "silent", "import time; time.sleep(30)")
    assert board.main([str(artifact_dir), "--tegrastats", str(silent), "--interval", "10"]) == 2
    assert "printed no 'RAM used/totalMB' line" in capsys.readouterr().err
