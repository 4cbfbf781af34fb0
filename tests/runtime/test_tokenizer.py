"""The tokenizers-only adapter (runtime/tokenizer.py) gives the same ids and text as transformers'
AutoTokenizer on every kind of tokenizer directory the exports write: the demo model's, the tiny
test tokenizer, the vocabulary-padded one of random-weight real shapes, and a GPT2Tokenizer saved
like a real OPT checkpoint's (with and without ``add_bos_token``)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, GPT2Tokenizer

from export.checkpoint import build_tokenizer
from runtime.decoding.detokenize import IncrementalDetokenizer
from runtime.errors import InvalidArgumentError
from runtime.tokenizer import Tokenizer, UnsupportedTokenizerError, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PAD_ID = 1  # OPT's <pad>, what runtime.load passes from the manifest
TEXTS = ["", " ", "  two  spaces  ", "Hello, my name is", "\n\ttab\r\nnewline", "café naïve 東京 🙂 ÿ",
         "</s>", "a</s>b<pad>c", "<s><unk> <s>", "name[The Eagle], eatType[coffee shop], food[French]",
         "x" * 300, "zero\u200bwidth\u00a0nbsp", "Ünïcödé ÀÉÎ ß ﬁ", "  leading", "trailing  "]


def _saved(tokenizer, directory: Path) -> Path:
    tokenizer.save_pretrained(directory)
    return directory


def _gpt2_style(directory: Path, add_bos_token: bool) -> Path:
    """A GPT2Tokenizer built from a vocabulary and merges, as transformers loads a real OPT checkpoint."""
    data = json.loads(build_tokenizer().backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split()) if isinstance(m, str) else tuple(m) for m in data["merges"]]
    GPT2Tokenizer(vocab=data["vocab"], merges=merges, bos_token="</s>", eos_token="</s>", unk_token="</s>",
                  pad_token="<pad>", add_bos_token=add_bos_token).save_pretrained(directory)
    return directory


MAKERS = {
    "demo": lambda d: ROOT / "models" / "opt-e2e-skipdecode",
    "tiny": lambda d: _saved(build_tokenizer(), d),
    "padded_vocab": lambda d: _saved(build_tokenizer(pad_to=2048), d),  # as random-weight real shapes
    "gpt2_bos": lambda d: _gpt2_style(d, True),
    "gpt2_no_bos": lambda d: _gpt2_style(d, False),
}


@pytest.fixture(scope="module", params=list(MAKERS))
def pair(request, tmp_path_factory):
    directory = Path(MAKERS[request.param](tmp_path_factory.mktemp(request.param)))
    ref = AutoTokenizer.from_pretrained(str(directory))
    ref.padding_side = "left"
    if ref.pad_token_id is None:
        ref.pad_token_id = PAD_ID
    return ref, Tokenizer.from_dir(directory, PAD_ID)


@pytest.mark.parametrize("special", [True, False])
def test_encode_matches_transformers(pair, special):
    ref, mine = pair
    for text in TEXTS:
        ids = ref(text, add_special_tokens=special)["input_ids"]
        assert mine(text, add_special_tokens=special)["input_ids"] == ids, text
        assert mine.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special), text


def test_batches_match_transformers(pair):
    ref, mine = pair
    for kind in ("np", "pt"):
        a, b = ref(TEXTS, padding=True, return_tensors=kind), mine(TEXTS, padding=True, return_tensors=kind)
        assert type(a["input_ids"]) is type(b.input_ids) and b.input_ids.dtype == a["input_ids"].dtype
        np.testing.assert_array_equal(np.asarray(b.input_ids), np.asarray(a["input_ids"]))
        np.testing.assert_array_equal(np.asarray(b.attention_mask), np.asarray(a["attention_mask"]))
    assert mine(TEXTS)["input_ids"] == ref(TEXTS)["input_ids"]  # unpadded lists
    assert mine(TEXTS, padding=True)["attention_mask"] == ref(TEXTS, padding=True)["attention_mask"]


def test_decode_and_special_tokens_match_transformers(pair):
    ref, mine = pair
    rng = random.Random(0)
    rows = [ref(t)["input_ids"] for t in TEXTS] + [[rng.randrange(len(ref)) for _ in range(40)] for _ in range(20)]
    rows += [list(range(len(ref))), [], [2, 1, 0, 3]]
    for ids in rows:
        for skip in (True, False):
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids
        assert mine.decode(np.array(ids, dtype=np.int64)) == ref.decode(ids)
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "vocab_size")
    assert [getattr(mine, n) for n in names] == [getattr(ref, n) for n in names]
    assert len(mine) == len(ref)


def test_incremental_detokenization_matches_transformers(pair):
    ref, mine = pair
    rng = random.Random(1)
    for _ in range(10):
        ids = [rng.randrange(len(ref)) for _ in range(30)]
        detok = IncrementalDetokenizer(mine)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text == ref.decode(ids, skip_special_tokens=True)


def test_unpadded_rows_of_different_lengths_are_no_tensor(pair):
    _, mine = pair
    with pytest.raises(InvalidArgumentError, match="padding=True"):
        mine(["a", "a longer prompt"], return_tensors="np")


def test_runtime_load_uses_the_adapter(generator):
    assert isinstance(generator.tokenizer, Tokenizer)


def test_special_token_outside_the_vocabulary_is_refused(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "[PAD]"}))
    with pytest.raises(UnsupportedTokenizerError, match=r"pad_token '\[PAD\]' is not a token of tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


UNSUPPORTED = {"split_special_tokens": ({"split_special_tokens": True}, "split_special_tokens=True"),
               # as a transformers 4 export writes it: transformers 5 then adds no BOS (checked below)
               "add_bos_token": ({"add_bos_token": True}, "sets add_bos_token"),
               "model_class": ({"tokenizer_class": "LlamaTokenizer"}, "names tokenizer_class 'LlamaTokenizer'")}


def _unsupported(directory: Path, kind: str = "split_special_tokens") -> Path:
    build_tokenizer().save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **UNSUPPORTED[kind][0]}))
    return directory


@pytest.mark.parametrize("kind", ["split_special_tokens", "add_bos_token"])
def test_unsupported_tokenizer_falls_back_to_transformers(tmp_path, kind):
    directory = _unsupported(tmp_path, kind)
    with pytest.raises(UnsupportedTokenizerError, match=UNSUPPORTED[kind][1]):
        Tokenizer.from_dir(directory)
    with pytest.warns(UserWarning, match="loading it with transformers' AutoTokenizer"):
        tok = load_tokenizer(directory, PAD_ID)
    assert not isinstance(tok, Tokenizer) and tok.padding_side == "left"
    ref = AutoTokenizer.from_pretrained(str(directory))
    assert [tok(t)["input_ids"] for t in TEXTS] == [ref(t)["input_ids"] for t in TEXTS]


def test_model_specific_class_is_refused(tmp_path):
    with pytest.raises(UnsupportedTokenizerError, match=UNSUPPORTED["model_class"][1]):
        Tokenizer.from_dir(_unsupported(tmp_path, "model_class"))


def test_unsupported_tokenizer_without_transformers_says_how_to_fix(tmp_path, monkeypatch):
    directory = _unsupported(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(UnsupportedTokenizerError, match="re-export the artifact, or pip install transformers"):
        load_tokenizer(directory, PAD_ID)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedTokenizerError, match="has no tokenizer.json"):
        load_tokenizer(directory, PAD_ID)


def _qwen2_tokenizer_dir(directory: Path) -> Path:
    """A Qwen2Tokenizer (what Qwen2/2.5/3 checkpoints name) saved by transformers 5, on the
    vocabulary and merges of the test tokenizer."""
    from transformers import Qwen2Tokenizer

    model = json.loads(build_tokenizer().backend_tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    Qwen2Tokenizer(vocab=model["vocab"], merges=merges).save_pretrained(directory)
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    return directory


def test_qwen2_tokenizer_reads_without_transformers_and_encodes_as_it(tmp_path, monkeypatch):
    """transformers 5's Qwen2Tokenizer builds its normalizer (NFC) and split pattern in Python; the
    adapter takes its tokenizer.json because it holds exactly those, so a runtime-only install (no
    transformers) loads a Qwen artifact with the ids and text transformers gives."""
    directory = _qwen2_tokenizer_dir(tmp_path)
    ref = AutoTokenizer.from_pretrained(str(directory))
    texts = TEXTS + ["cafe\u0301 12345 it's I'LL", "a\r\n\r\nb  \n c"]  # NFC, digits one by one, contractions
    monkeypatch.setitem(sys.modules, "transformers", None)  # the runtime-only install
    mine = load_tokenizer(directory, PAD_ID)
    assert isinstance(mine, Tokenizer)
    assert [mine(t)["input_ids"] for t in texts] == [ref(t)["input_ids"] for t in texts]
    ids = ref("café naïve 東京 🙂 12")["input_ids"]
    assert mine.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_qwen2_tokenizer_with_another_pipeline_is_refused(tmp_path):
    directory = _qwen2_tokenizer_dir(tmp_path)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["normalizer"] = {"type": "NFKC"}  # transformers' Qwen2Tokenizer would use NFC regardless
    (directory / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedTokenizerError, match="normalizer is not the one transformers' Qwen2Tokenizer builds"):
        Tokenizer.from_dir(directory)
