"""Incremental detokenization gives exactly the text of decoding the whole row."""

from __future__ import annotations

import random

import pytest

from export.checkpoint import build_tokenizer
from runtime.decoding.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("seed", range(20))
def test_deltas_concatenate_to_the_full_decode(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["Hello", " wörld", " 日本語", " café", "!", " 🙂", "\n", " the", "  "])
                   for _ in range(12))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if seed % 2:  # arbitrary ids too: bytes that never complete a character, special tokens
        ids = [rng.randrange(len(tok)) for _ in range(30)]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    out = "".join(deltas) + detok.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)
    if seed % 2 == 0:
        assert out == text


def test_a_split_character_waits_for_its_last_byte(tok):
    ids = tok(" 🙂", add_special_tokens=False)["input_ids"]
    byte_ids = [tok.convert_tokens_to_ids(t) for t in tok.convert_ids_to_tokens(ids)]
    pieces = [tok.convert_tokens_to_ids(ch) for t in tok.convert_ids_to_tokens(byte_ids) for ch in t]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in pieces]  # one byte per token: the emoji's 4 bytes arrive apart
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == " 🙂"
