"""Deep copies (runtime.decoding.copying): when a row's text lies in a rare string of its prompt, its
next step runs the deep set too, after the K/V its skipped positions lack there is written from
their hidden state past the warm-up layers. So the tokens are those of tools.finetune's dense pass
with each position's layers as the run chose them; the rule picks the names, not the common words."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime
from export.build import BuildOptions, build
from runtime.decoding.copying import CopyRule, DeepCopies
from runtime.errors import ArtifactError, InvalidArgumentError
from runtime.models import skip_model
from tests.conftest import PROMPTS
from tests.families import save_tiny_checkpoint
from tools.finetune.skip import skip_forward

MR = "name[Corgladun Stable], eatType[coffee shop], food[Chinese], near[The Jade Dovecote]"


@pytest.mark.parametrize("text, due", [
    ("Cor", True),  # inside a name
    ("Corgladun", True),  # a name's word the prompt continues
    ("Corgladun Stable", True),  # at the name's end: whether it stops takes depth too
    ("It is near", True),  # the prompt follows "near" with a rare string
    ("The", True),  # "[The Jade": a function word the prompt follows with a name
    ("The Jade Dovecote", True),
    ("It is a coffee", False),  # task words, told by the model's common words
    ("It serves Chinese", False),
    ("It is", False),  # function words
    ("Corgladun ", False),  # between words: the next token starts its own
    ("Glad", False),  # not at a word's start in the prompt
    ("", False),
])
def test_which_texts_run_deep(text, due):
    rule = CopyRule(MR, frozenset({"coffee", "shop", "Chinese", "food", "near"}))
    assert rule.due(text) is due


def test_a_possessive_name_and_its_stem():
    rule = CopyRule("name[Fiobri's], near[Café Kaikai]", frozenset({"Café"}))
    assert rule.due("Fiobri's") and rule.due("Fiobri") and rule.due("near Café")
    assert not CopyRule("name[The Mill]").due("the")  # "the" is no name, wherever it is


def test_the_deep_set():
    assert DeepCopies(4).deep_set(1, 8) == {0, 5, 6, 7}
    assert DeepCopies.default(30).layers == 16
    with pytest.raises(ArtifactError, match=r"layers must lie in \[1, 8\]"):
        DeepCopies.from_manifest({"layers": 9}, 8)
    with pytest.raises(ArtifactError, match="common_words must be a list of strings"):
        DeepCopies.from_manifest({"layers": 4, "common_words": "coffee"}, 8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama 3 checkpoint (8 layers) and its fused-graph artifact."""
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("deep-ckpt"), "llama3", hidden_size=64, num_hidden_layers=8)
    out = tmp_path_factory.mktemp("deep-art") / "model"
    build(BuildOptions(model=str(ckpt), out=str(out), progress=False), log=lambda *_: None)
    return ckpt, out


def dense_tokens(ckpt, result, prompts_ids) -> list[list[int]]:
    """Each row's greedy tokens from the dense pass with the layers the run gave each position."""
    model = skip_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval())
    L, out = model.num_layers, []
    for b, prompt in enumerate(prompts_ids):
        generated = result.token_ids[b]
        sets = {s.step: s.layers for s in result.stats.steps if b in s.rows}
        ids = torch.tensor([prompt + generated[:-1]])  # (1, T): the prompt, then each step's input
        mask = torch.ones((1, ids.shape[1], L), dtype=torch.bool)  # (1, T, L)
        for g in range(len(generated) - 1):
            mask[0, len(prompt) + g] = False
            mask[0, len(prompt) + g, list(sets[g])] = True
        with torch.no_grad():
            logits = skip_forward(model, ids, torch.ones_like(ids), mask)  # (1, T, V)
        out.append(logits[0, len(prompt) - 1:].argmax(-1).tolist())
    return out


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_deep_steps_are_the_dense_pass_with_their_layers(llama, backend, monkeypatch):
    """Every other word of the text runs deep (a rule of the test's own, so that the random model's
    text needs no name): the tokens equal the dense pass's, gaps written at each deep layer."""
    ckpt, art = llama
    monkeypatch.setattr(CopyRule, "due", lambda self, text: len(text.split()) % 2 == 1)
    g = runtime.load(art, backend=backend, max_batch=4, check_hashes=False)
    policy = {"max_layers": 3, "min_layers": 2, "horizon": 8}
    result = g.generate(PROMPTS[:3], 16, policy=policy, deep_copies=True, ignore_eos=True)
    plain = g.generate(PROMPTS[:3], 16, policy=policy, deep_copies=False, ignore_eos=True)
    ids = [g.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    g.close()
    s = result.stats
    assert s.deep_steps > 0 and s.filled_positions > 0 and plain.stats.deep_steps == 0
    assert s.to_dict()["deep_steps"] == s.deep_steps and "deep_steps" not in plain.stats.to_dict()
    tokens, layers = s.row_steps  # rows of a step at different depths each count their own layers
    assert tokens == 3 * 15 and s.achieved_layer_ratio == pytest.approx(8 * tokens / layers)
    assert any(len(step.layers) > 3 for step in s.steps)  # the deep set: warm-up + the top 4 of 8
    assert result.token_ids == dense_tokens(ckpt, result, ids)
    assert plain.token_ids == dense_tokens(ckpt, plain, ids)


def test_the_manifest_turns_it_on_and_a_call_off(llama, tmp_path, monkeypatch):
    _, art = llama
    copy = tmp_path / "model"
    shutil.copytree(art, copy)
    path = copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["policy"]["deep_copies"] = {"layers": 5, "common_words": ["the"]}
    path.write_text(json.dumps(manifest))
    monkeypatch.setattr(CopyRule, "due", lambda self, text: True)
    with runtime.load(copy, check_hashes=False) as g:
        on = g.generate(PROMPTS[:1], 6, speedup=4, ignore_eos=True)
        assert on.stats.deep_steps == 5 and all(len(s.layers) >= 5 for s in on.stats.steps)
        assert g.request(PROMPTS[:1], 6, speedup=4).copies == DeepCopies(5, frozenset({"the"}))
        assert g.generate(PROMPTS[:1], 6, speedup=4, deep_copies=False).stats.deep_steps == 0
        assert g.generate(PROMPTS[:1], 6, speedup=4, lossless=True).stats.deep_steps == 0  # full depth's tokens
        with pytest.raises(InvalidArgumentError, match="needs prefill='full'"):
            g.generate(PROMPTS[:1], 6, speedup=4, prefill="policy", deep_copies=True)
    manifest["policy"]["deep_copies"] = {"layers": 99}
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"deep_copies.layers must lie in \[1, 8\]"):
        runtime.load(copy, check_hashes=False)


def test_deep_copies_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="deep_copies must be True, False or None, got 'yes'"):
        runtime.GenerationConfig(deep_copies="yes")


def test_the_rule_reads_each_rows_own_prompt(llama):
    _, art = llama
    with runtime.load(art, check_hashes=False) as g:
        request = g.request(["name[Kiln Quay]", "a longer prompt about Lantern Quay"], 4, speedup=2,
                            deep_copies=True)
    assert [s.copy.rule.prompt for s in request.seqs] == ["name[Kiln Quay]", "a longer prompt about Lantern Quay"]
    assert np.array_equal(request.seqs[0].copy.filled, np.zeros(8, np.int64))


def test_the_server_and_the_command_line_spell_it():
    from runtime.__main__ import _parser
    from runtime.serve.protocol import RequestError, parse_completion

    body = {"model": "m", "prompt": "name[Kiln Quay]"}
    assert parse_completion(body, "m", 4).generation_config().deep_copies is None
    assert parse_completion({**body, "deep_copies": False}, "m", 4).generation_config().deep_copies is False
    with pytest.raises(RequestError, match="deep_copies must be true or false, got 'no'"):
        parse_completion({**body, "deep_copies": "no"}, "m", 4)
    assert _parser().parse_args(["art", "p", "--no-deep-copies"]).deep_copies is False
    assert _parser().parse_args(["art", "p"]).deep_copies is None


def test_fills_in_calls_a_backend_takes(llama, monkeypatch):
    """A backend whose calls take at most 2 positions (TensorRT's profiles) fills in pieces: the
    same tokens as in one call."""
    _, art = llama
    monkeypatch.setattr(CopyRule, "due", lambda self, text: len(text.split()) % 4 == 3)
    policy = {"max_layers": 3, "min_layers": 2, "horizon": 8}
    with runtime.load(art, max_batch=2, check_hashes=False) as g:
        whole = g.generate(PROMPTS[:2], 16, policy=policy, deep_copies=True, ignore_eos=True)
        monkeypatch.setattr(type(g.backend), "max_tokens", lambda self: 2)
        pieces = g.generate(PROMPTS[:2], 16, policy=policy, deep_copies=True, ignore_eos=True)
    assert whole.stats.filled_positions > 2 * whole.stats.deep_steps  # gaps longer than a call
    assert pieces.token_ids == whole.token_ids
    assert pieces.stats.filled_positions == whole.stats.filled_positions
