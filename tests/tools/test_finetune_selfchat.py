"""tools.finetune.selfchat: the model writes the requests and answers them through its chat
template; the CSV holds the rendered chat prompt and the finished answer."""

from __future__ import annotations

import csv

import pytest

from runtime.generator import Generator
from tests.families import save_tiny_checkpoint
from tests.runtime.serve_helpers import TEMPLATE
from tools.finetune import selfchat


@pytest.fixture(scope="module")
def chat_artifact(tmp_path_factory):
    """A tiny Llama whose tokenizer carries a chat template, with room for a written request."""
    from transformers import AutoTokenizer

    from export.build import BuildOptions, build

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("selfchat-ckpt"), "llama3", max_position_embeddings=512)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(checkpoint)
    out = tmp_path_factory.mktemp("selfchat-art") / "model"
    build(BuildOptions(model=str(checkpoint), out=str(out), progress=False, draft_head="none", draft_layers="none"),
          log=lambda *_: None)
    return out, tok


def test_requests_are_distinct_kinds_and_topics_in_a_seeded_order():
    first = selfchat.requests(40, seed=0)
    assert len(set(first)) == 40 and first == selfchat.requests(40, seed=0) != selfchat.requests(40, seed=1)
    assert first[0].startswith("Write a ") and first[0].endswith("Write only that message, nothing else.")
    assert len(selfchat.requests(10_000, seed=0)) == len(selfchat.KINDS) * len(selfchat.TOPICS)


@pytest.mark.parametrize("text, expected", [
    ('  "How do I keep basil alive indoors?"\n\nSure! Here is ...', "How do I keep basil alive indoors?"),
    ("Hi", None), ("x" * 401, None),
])
def test_clean_keeps_the_first_paragraph_unquoted(text, expected):
    assert selfchat.clean(text) == expected


def test_selfchat_writes_chat_prompts_and_their_answers(chat_artifact, tmp_path, monkeypatch, capsys):
    artifact, tok = chat_artifact
    real = Generator.generate

    def finishing(self, *args, **kwargs):  # a random model rarely samples EOS: count every row as finished
        result = real(self, *args, **kwargs)
        result.finish_reasons = ["eos"] * len(result.texts)
        return result

    monkeypatch.setattr(Generator, "generate", finishing)
    out = tmp_path / "chat.csv"
    assert selfchat.main(["--model", str(artifact), "--out", str(out), "--prompts", "6", "--max-new-tokens", "24",
                          "--batch-size", "4", "--threads", "1"]) == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    users = int(capsys.readouterr().out.split()[0])
    assert 0 < len(rows) == users <= 6
    for row in rows:  # the template's rendering of one user turn, then the answer
        assert row["prompt"].startswith(tok.bos_token + "user: ") and row["prompt"].endswith("\nassistant:")
        assert row["target"] == row["target"].strip() and row["target"]


def test_selfchat_says_when_no_answer_finished(chat_artifact, tmp_path, capsys):
    artifact, _ = chat_artifact
    assert selfchat.main(["--model", str(artifact), "--out", str(tmp_path / "x.csv"), "--prompts", "2",
                          "--max-new-tokens", "2", "--threads", "1"]) == 2
    assert "finished no answer within --max-new-tokens 2; raise it" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()
