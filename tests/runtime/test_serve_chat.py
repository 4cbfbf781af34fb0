"""/v1/chat/completions on a tiny artifact whose tokenizer carries a chat template: the prompt is
the one transformers' apply_chat_template builds, the answer the runtime's for that prompt."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("jinja2")

import runtime  # noqa: E402
from runtime.serve import ServeConfig, create_app  # noqa: E402
from tests.runtime.serve_helpers import MESSAGES, LiveServer, chat_artifact, read_sse  # noqa: E402, F401

pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")

TIMEOUT = 60


@pytest.fixture(scope="module")
def chat(chat_artifact):
    directory, tok = chat_artifact
    gen = runtime.load(directory, threads=1)
    try:
        with LiveServer(create_app(gen, ServeConfig(close_generator=False))) as live:
            with httpx.Client(base_url=live.url, timeout=TIMEOUT) as client:
                yield client, gen, tok
    finally:
        gen.close()


def test_prompt_is_transformers_apply_chat_template(chat):
    client, gen, tok = chat
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = gen.generate([ids], 8, ignore_eos=True, logprobs=2)
    body = dict(messages=MESSAGES, max_completion_tokens=8, temperature=0, ignore_eos=True, logprobs=True,
                top_logprobs=2)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    (ch,) = out["choices"]
    assert ch["message"] == {"role": "assistant", "content": expected.texts[0]}
    assert ch["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 8
    content = ch["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([t.logprob for t in expected.logprobs[0]], abs=1e-6)
    assert [c["token"] for c in content] == [tok.decode([i]) for i in expected.token_ids[0]]
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode()) for c in content)

    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200
        chunks, done = read_sse(s.iter_lines())
    assert done and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected.texts[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]


def test_n_and_no_max_tokens_fill_the_context(chat):
    client, gen, tok = chat
    r = client.post("/v1/chat/completions", json=dict(messages=MESSAGES, n=2, seed=5, ignore_eos=True))
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 2 * (gen.max_length - len(ids))  # the rest of the 64 positions
    expected = gen.generate([ids, ids], gen.max_length - len(ids), ignore_eos=True, do_sample=True, top_k=0, seed=5)
    assert [c["message"]["content"] for c in out["choices"]] == expected.texts


@pytest.mark.parametrize("body, param, words", [
    (dict(messages=[{"role": "assistant", "content": "Hi"}]), "messages", "start with a system or user"),
    (dict(messages=[]), "messages", "non-empty list"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "role is one of"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content", "only text parts"),
    (dict(messages=MESSAGES, max_tokens=4, max_completion_tokens=5), "max_tokens", "disagree"),
    (dict(messages=MESSAGES, top_logprobs=2), "top_logprobs", "needs logprobs: true"),
    (dict(messages=MESSAGES, max_completion_tokens=60), "max_tokens", "for the answer, but max_tokens is 60; ask"),
    # no max_tokens and a conversation past the context: what it takes and that none is left, no
    # negative count of tokens (a user trial got "max_tokens -839 more")
    (dict(messages=[{"role": "user", "content": "tell me more " * 40}]), "messages",
     "which leaves none for the answer; shorten"),
    (dict(messages=MESSAGES, tools=[]), "tools", "unrecognized request field"),
])
def test_bad_chat_requests(chat, body, param, words):
    client, _, _ = chat
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert " -" not in err["message"]
