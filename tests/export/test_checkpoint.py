import json
import re

import pytest

from export import checkpoint
from runtime.errors import HubDownloadError, ModelNotFoundError, UnsupportedModelError
from tests.conftest import save_tiny_checkpoint


@pytest.mark.parametrize("spec, hub_id", [
    ("opt-1.3b", "facebook/opt-1.3b"), ("OPT-350m", "facebook/opt-350m"),
    ("facebook/opt-125m", "facebook/opt-125m"), ("someone/opt-finetuned", "someone/opt-finetuned")])
def test_aliases_and_hub_ids(spec, hub_id):
    source = checkpoint.resolve(spec)
    assert (source.kind, source.location) == ("hub", hub_id)


def test_unknown_alias_lists_the_known_ones():
    with pytest.raises(ModelNotFoundError) as info:
        checkpoint.resolve("opt-999m")
    assert "unknown model 'opt-999m'" in str(info.value)
    assert "opt-1.3b" in str(info.value) and "tiny-random" in str(info.value)


def test_missing_directory(tmp_path):
    missing = tmp_path / "nowhere" / "opt"
    with pytest.raises(ModelNotFoundError, match=f"model directory '{missing}' does not exist"):
        checkpoint.resolve(str(missing))


def test_directory_without_config(tmp_path):
    with pytest.raises(UnsupportedModelError, match="has no config.json"):
        checkpoint.resolve(str(tmp_path))


def test_an_unsupported_family_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"is a 'gpt2' checkpoint; this toolkit exports model_type "
                                                    r"opt, llama, qwen2, qwen3"):
        checkpoint.load(checkpoint.resolve(str(tmp_path)))


def test_hub_failure_says_how_to_pass_a_directory(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to the hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(HubDownloadError) as info:
        checkpoint.load(checkpoint.resolve("opt-1.3b"))
    message = str(info.value)
    assert "could not get facebook/opt-1.3b from the Hugging Face Hub" in message
    assert "--model /path/to/opt-1.3b" in message


def test_random_weights_need_a_known_architecture():
    assert checkpoint.resolve("opt-125m", random_weights=True).kind == "random"
    with pytest.raises(ModelNotFoundError, match="random weights need a known architecture"):
        checkpoint.resolve("opt-7b", random_weights=True)


def test_random_architecture_has_real_shapes():
    config = checkpoint.random_config("opt-350m", vocab_size=512)
    assert (config.num_hidden_layers, config.hidden_size, config.word_embed_proj_dim) == (24, 1024, 512)
    assert not config.do_layer_norm_before and config.vocab_size == 50272


def test_tokenizer_follows_opt_conventions():
    tok = checkpoint.build_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    ids = tok("Hello world").input_ids
    assert ids[0] == 2, "OPT prepends </s> as BOS"
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"


@pytest.mark.parametrize("keep", [5, 0.5])
def test_truncated_weights_name_the_file(tmp_path, capsys, keep):
    from export.__main__ import main as export_main
    from runtime.errors import CorruptCheckpointError

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep] if isinstance(keep, int) else data[:int(len(data) * keep)])
    with pytest.raises(CorruptCheckpointError) as info:
        checkpoint.load(checkpoint.resolve(str(ckpt)))
    assert f"cannot read the weights in {weights} (" in str(info.value)
    assert "truncated or corrupted" in str(info.value)
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot read the weights in {weights}" in err and "Traceback" not in err, err


def test_a_checkpoint_without_tokenizer_files_says_so(tmp_path, capsys):
    from export.__main__ import main as export_main

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "pre_ln")
    for f in ckpt.iterdir():
        if f.name not in ("config.json", "generation_config.json", "model.safetensors"):
            f.unlink()
    message = (f"{ckpt} has no tokenizer files (tokenizer.json, vocab.json, tokenizer.model): copy them from "
               f"where the checkpoint came from")
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        checkpoint.load(checkpoint.resolve(str(ckpt)))
    assert export_main(["build", "--model", str(ckpt), "--out", str(tmp_path / "out"), "-q"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}") and not (tmp_path / "out").exists()


def test_random_weights_of_real_shapes_get_a_tokenizer_of_the_models_vocabulary():
    """A 512-token tokenizer for a 50,272-token model decoded every generation to ''."""
    small = checkpoint.build_tokenizer()
    tok = checkpoint.build_tokenizer(pad_to=checkpoint.OPT_VOCAB_SIZE)
    assert len(tok) == checkpoint.OPT_VOCAB_SIZE
    assert tok("Hello world").input_ids == small("Hello world").input_ids  # prompts encode as before
    high = [checkpoint.OPT_VOCAB_SIZE - 1, 20000, 600]
    assert all(tok.decode([i]).strip() for i in high)  # every id the model can emit shows as text
    assert tok.decode(high).startswith(" ")


def test_random_real_shape_model_and_tokenizer_agree(monkeypatch):
    monkeypatch.setitem(checkpoint.OPT_ARCHS, "opt-125m", (2, 32, 4, 64, 32, True))  # small, same vocab
    model, tok = checkpoint.build_random("opt-125m")
    assert model.config.vocab_size == len(tok) == checkpoint.OPT_VOCAB_SIZE
    ids = model.generate(**tok(["Hello"], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert tok.decode(ids[0, -4:], skip_special_tokens=True) != ""
