"""tools.evaluate.agreement: quantized artifacts' next-token predictions against a reference's."""

import numpy as np
import pytest

from export.build import BuildOptions, build
from tests.conftest import save_tiny_checkpoint
from tools.evaluate import agreement

TEXT = ("The keeper climbed the stairs each evening to light the lamp, and the ships that passed the rocks "
        "saw it burn through fog and storm. One winter a bottle washed ashore with a letter inside, written "
        "in a hand nobody in the village knew, asking for news of a sailor lost forty years before.")


def test_prompts_are_seeded_windows_of_the_texts_words():
    prompts = agreement.prompts_of(TEXT, 20, seed=3)
    assert prompts == agreement.prompts_of(TEXT, 20, seed=3) != agreement.prompts_of(TEXT, 20, seed=4)
    assert all(3 <= len(p.split()) <= 24 and p in " ".join(TEXT.split()) for p in prompts)
    with pytest.raises(agreement.AgreementError, match="the text has 5 words; windows of up to 24 need more"):
        agreement.prompts_of("one two three four five", 2)


def test_compare_counts_top1_and_kl():
    ref = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]]))
    same = agreement.compare("same", ref, ref.copy())
    assert same.top1 == 1.0 and same.mean_kl == pytest.approx(0.0, abs=1e-12)
    other = np.log(np.array([[0.7, 0.2, 0.1], [0.5, 0.2, 0.3]]))  # the second argmax moved
    row = agreement.compare("other", ref, other)
    kl = 0.1 * np.log(0.1 / 0.5) + 0.6 * np.log(0.6 / 0.2) + 0.3 * np.log(0.3 / 0.3)
    assert row.top1 == 0.5 and row.mean_kl == pytest.approx(kl / 2)
    with pytest.raises(agreement.AgreementError, match="2 wide, the reference's 3"):
        agreement.compare("narrow", ref, ref[:, :2])


def test_the_cli_compares_a_float_export_with_itself_and_an_int4_one(tmp_path, capsys):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln", max_position_embeddings=256)
    for name, weights in (("fp32", "float"), ("int4", "int4")):
        build(BuildOptions(model=str(ckpt), out=str(tmp_path / name), progress=False, weights=weights, block_size=16),
              log=lambda *_: None)
    (tmp_path / "text.txt").write_text(TEXT)
    assert agreement.main(["--reference", str(tmp_path / "fp32"), "--model", f"same={tmp_path / 'fp32'}",
                           str(tmp_path / "int4"), "--text", str(tmp_path / "text.txt"), "--prompts", "10"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| model | top-1 agreement (10 prompts) | mean KL (nats) |"
    assert lines[2] == "| same | 1.000 | 0.0000 |"
    name, top1, kl = (c.strip() for c in lines[3].strip("|").split("|"))
    assert name == str(tmp_path / "int4") and 0 < float(kl) and 0 <= float(top1) <= 1


def test_the_torch_backend_on_an_int4_artifact_agrees_with_onnx_runtimes(tmp_path, capsys):
    """--backend torch: the compared artifact on the torch backend (its int4 blocks, the GPU's path on a
    GPU), the reference on ONNX Runtime at float activations: the same artifact agrees with itself."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln", max_position_embeddings=256)
    build(BuildOptions(model=str(ckpt), out=str(tmp_path / "int4"), progress=False, weights="int4", block_size=16),
          log=lambda *_: None)
    (tmp_path / "text.txt").write_text(TEXT)
    assert agreement.main(["--reference", str(tmp_path / "int4"), "--model", f"torch={tmp_path / 'int4'}",
                           "--backend", "torch", "--device", "cpu", "--text", str(tmp_path / "text.txt"),
                           "--prompts", "10", "--deterministic", "--int4-kernel", "onnxruntime"]) == 0
    name, top1, kl = (c.strip() for c in capsys.readouterr().out.strip().splitlines()[2].strip("|").split("|"))
    assert name == "torch" and top1 == "1.000" and float(kl) < 1e-3
    assert agreement.main(["--reference", str(tmp_path / "int4"), "--model", str(tmp_path / "int4"), "--device",
                           "cuda", "--text", str(tmp_path / "text.txt")]) == 2
    assert "--device applies to --backend torch" in capsys.readouterr().err
    assert agreement.main(["--reference", str(tmp_path / "int4"), "--model", str(tmp_path / "int4"),
                           "--torch-int4-kernel", "tinygemm", "--text", str(tmp_path / "text.txt")]) == 2
    assert "--torch-int4-kernel applies to --backend torch (--int4-kernel is ONNX Runtime's)" in capsys.readouterr().err


def test_llamacpp_rows_score_the_same_token_ids_through_the_worker(tmp_path, capsys):
    """--llamacpp: the reference's token ids go to llama.cpp's worker (tools/bench/llamacpp_worker.py
    logits, run by --llamacpp-python) and its .npy comes back as a row. A stand-in python answers the
    venv probe and writes the reference's own logits, read from a file, where the worker would."""
    import json

    import runtime
    from export import checkpoint
    from tests.families import tiny_model
    from tests.tools.llamacpp_stand_in import stand_in_python
    from tools.bench.gguf_file import write_checkpoint_gguf

    path = write_checkpoint_gguf(tiny_model("smollm2", max_position_embeddings=256), checkpoint.build_tokenizer(),
                                 tmp_path / "m.gguf")
    build(BuildOptions(model=str(path), out=str(tmp_path / "fp32"), progress=False, check=False), log=lambda *_: None)
    (tmp_path / "text.txt").write_text(TEXT)
    prompts = agreement.prompts_of(TEXT, 6)
    with runtime.load(tmp_path / "fp32") as gen:
        np.save(tmp_path / "theirs.npy", agreement.next_logits(gen, prompts))
        ids = [[int(i) for i in gen.tokenizer(p)["input_ids"]] for p in prompts]
    # argv: logits, MODEL, IDS, OUT, --threads N
    python = stand_in_python(tmp_path, "import shutil, sys\n"
                             f"open({str(tmp_path / 'seen.json')!r}, 'w').write(open(sys.argv[3]).read())\n"
                             f"shutil.copy({str(tmp_path / 'theirs.npy')!r}, sys.argv[4])\n")
    assert agreement.main(["--reference", str(tmp_path / "fp32"), "--llamacpp", f"llama.cpp={path}",
                           "--llamacpp-python", str(python), "--text", str(tmp_path / "text.txt"),
                           "--prompts", "6"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[2] == "| llama.cpp | 1.000 | 0.0000 |"
    assert json.loads((tmp_path / "seen.json").read_text()) == ids


def test_llamacpp_rows_say_what_is_missing(tmp_path, capsys):
    (tmp_path / "text.txt").write_text(TEXT)
    argv = ["--reference", str(tmp_path), "--text", str(tmp_path / "text.txt"), "--prompts", "2"]
    assert agreement.main(argv) == 2
    assert "nothing to compare: give --model DIR (an artifact) or --llamacpp FILE.gguf" in capsys.readouterr().err
    with pytest.raises(agreement.AgreementError, match="--llamacpp needs llama-cpp-python: .*--llamacpp-python PY"):
        agreement.llamacpp_python(str(tmp_path / "no-python"))
