"""tools.bench.decode: artifacts timed side by side, each on the int4 kernel asked for."""

import pytest

from export.build import BuildOptions, build
from runtime.errors import InvalidArgumentError
from tests.conftest import save_tiny_checkpoint
from tools.bench import decode


def test_specs_name_a_directory_and_its_int4_kernel():
    assert decode.parse_spec("a=/x/y") == ("a", "/x/y", "auto")
    assert decode.parse_spec("b=/x/y:onnxruntime") == ("b", "/x/y", "onnxruntime")
    assert decode.parse_spec("/x/y") == ("/x/y", "/x/y", "auto")
    assert decode.parse_spec("d=/x/y:skipdecode-avx2") == ("d", "/x/y", "skipdecode-avx2")
    assert decode.parse_spec("e=/x/y:onnxruntime+deterministic") == ("e", "/x/y", "onnxruntime+deterministic")
    with pytest.raises(InvalidArgumentError, match=r"one of auto, skipdecode, skipdecode-avx2, onnxruntime \(each may "
                                                   r"end in \+deterministic\), or llamacpp for a GGUF file, not 'mlas'"):
        decode.parse_spec("c=/x/y:mlas")


def test_the_avx2_kernel_is_asked_for_during_its_load_alone(monkeypatch):
    from runtime.platform import kernels

    seen = []
    fake = type("R", (), {"load": staticmethod(lambda d, **kw: seen.append((kw, decode.os.environ.get(kernels.ISA_ENV))))})
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    decode._load(fake, "/x", 2, "skipdecode-avx2")
    decode._load(fake, "/x", 2, "skipdecode")
    decode._load(fake, "/x", 2, "onnxruntime+deterministic")
    assert seen == [({"threads": 2, "int4_kernel": "skipdecode"}, "avx2"), ({"threads": 2, "int4_kernel": "skipdecode"}, None),
                    ({"threads": 2, "int4_kernel": "onnxruntime", "deterministic": True}, None)]
    assert kernels.ISA_ENV not in decode.os.environ


def test_a_run_times_every_artifact_each_round_and_compares_medians(tmp_path, capsys):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln", max_position_embeddings=256)
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "int4"), progress=False, weights="int4", block_size=16),
          log=lambda *_: None)
    art = tmp_path / "int4"
    assert decode.main([f"ours={art}", f"mlas={art}:onnxruntime", "--tokens", "6", "--rounds", "3",
                        "--prompt", "the keeper climbed the stairs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("`python -m tools.bench.decode ours=") and lines[0].endswith("--prompt 'the keeper climbed the stairs'`")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [r[0] for r in rows] == ["ours", "mlas"] and rows[0][3] == rows[0][5] == "1.00x"
    for name, rounds, median, ratio, prompt, prompt_ratio in rows:
        values = [float(v) for v in rounds.split(" / ")]
        assert len(values) == 3 and all(v > 0 for v in values) and float(median) in values
        assert float(prompt) > 0 and prompt_ratio.endswith("x")
    assert decode.main([str(art), "--tokens", "1"]) == 2
    assert "decode needs 2 tokens or more" in capsys.readouterr().err


def test_a_llamacpp_row_runs_the_worker_each_round(tmp_path, monkeypatch):
    """NAME=FILE.gguf:llamacpp: a round is a process of llamacpp_worker.py's bench with the file, the
    prompt, the threads and the tokens, its record read back as (decode ms/token, prompt ms). A
    stand-in python answers the venv probe and the bench."""
    import json

    from export import checkpoint
    from tests.families import tiny_model
    from tests.tools.llamacpp_stand_in import stand_in_python
    from tools.bench.gguf_file import write_checkpoint_gguf

    path = write_checkpoint_gguf(tiny_model("smollm2"), checkpoint.build_tokenizer(), tmp_path / "m.gguf")
    python = stand_in_python(tmp_path, "import json, sys\n"  # argv: bench, SPEC
                             f"open({str(tmp_path / 'specs')!r}, 'a').write(sys.argv[2] + '\\n')\n"
                             "print(json.dumps({'decode_s': 0.5, 'generated_tokens': 11, 'prefill_s': 0.02}))\n")
    assert decode.parse_spec(f"q4_1={path}:llamacpp") == ("q4_1", str(path), "llamacpp")
    times = decode.measure([f"q4_1={path}:llamacpp"], tokens=11, rounds=2, threads=3, prompt="hi",
                           llamacpp_python=str(python))
    assert times == {"q4_1": [(50.0, 20.0), (50.0, 20.0)]}
    specs = [json.loads(line) for line in (tmp_path / "specs").read_text().splitlines()]
    assert specs == [{"prompts": ["hi"], "threads": 3, "llamacpp_gguf": str(path), "warmup_tokens": decode.WARMUP,
                      "new_tokens": 11}] * 2
