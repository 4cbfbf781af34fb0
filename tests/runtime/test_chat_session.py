"""``python -m runtime DIR --chat`` without prompts: an interactive chat whose every turn renders the
whole conversation through the chat template, streams the answer, and ends on Ctrl-D."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("jinja2")

import runtime  # noqa: E402
from runtime.__main__ import main  # noqa: E402
from tests.runtime.serve_helpers import chat_artifact  # noqa: E402, F401

pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")


def _chat(directory, monkeypatch, capsys, lines: str, *argv) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main([str(directory), "--chat", "--no-check-hashes", "--max-new-tokens", "3", "--ignore-eos", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_each_turn_sees_the_whole_conversation(chat_artifact, monkeypatch, capsys):
    directory, tok = chat_artifact
    code, out, err = _chat(directory, monkeypatch, capsys, "The Eagle?\nAnd the Mill?\n", "--system", "Be brief.")
    assert code == 0 and "Ctrl-D ends the chat" in err and err.count(" tokens, ") == 2
    with runtime.load(directory, threads=1) as gen:
        history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The Eagle?"}]
        first = gen.generate(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False), 3,
                             ignore_eos=True).texts[0]
        history += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "And the Mill?"}]
        second = gen.generate(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False), 3,
                              ignore_eos=True).texts[0]
    # input()'s "> " prompts and the streamed answers, each answer ending its line
    assert out == f"> {first}\n> {second}\n> "


def test_reset_forgets_and_exit_ends(chat_artifact, monkeypatch, capsys):
    directory, _ = chat_artifact
    _, alone, _ = _chat(directory, monkeypatch, capsys, "And the Mill?\n")
    code, out, err = _chat(directory, monkeypatch, capsys, "The Eagle?\n/reset\nAnd the Mill?\n/exit\nnever read\n")
    assert code == 0 and "(a new conversation)" in err and err.count(" tokens, ") == 2
    assert out.split("\n")[1] == "> " + alone.split("\n")[0]  # after /reset ("> " of its line): as alone


def test_the_oldest_turns_go_when_the_conversation_outgrows_the_context(chat_artifact, monkeypatch, capsys):
    directory, _ = chat_artifact
    long = "tell me about the river and the city centre " * 3  # ~30 tokens of the tiny model's 64 positions
    code, _, err = _chat(directory, monkeypatch, capsys, f"{long}\n{long}\n")
    assert code == 0 and "the 2 oldest messages were dropped" in err and err.count(" tokens, ") == 2


def test_a_message_past_the_context_is_refused_and_the_chat_goes_on(chat_artifact, monkeypatch, capsys):
    directory, _ = chat_artifact
    huge = "tell me about the river " * 40  # past the tiny model's 64 positions on its own
    code, out, err = _chat(directory, monkeypatch, capsys, f"{huge}\nThe Eagle?\n")
    assert code == 0 and err.count("error: ") == 1 and err.count(" tokens, ") == 1
    assert out.count("> ") == 3  # the refused message's prompt, the next one's, and the last


def test_chat_options_that_need_prompts_are_refused(chat_artifact, capsys):
    directory, _ = chat_artifact
    assert main([str(directory), "--chat", "--json"]) == 2
    assert capsys.readouterr().err == ("error: --json needs prompts; an interactive chat (--chat without prompts) "
                                       "streams its answers\n")
    assert main([str(directory)]) == 2
    assert capsys.readouterr().err == "error: give one or more prompts, or --chat alone for an interactive chat\n"
