"""The official ``openai`` client, unchanged, against a live server: every OpenAI field the server
implements, completions on the test model and chat on a tiny model with a chat template."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import runtime  # noqa: E402
from runtime.serve import ServeConfig, create_app  # noqa: E402
from tests.conftest import PROMPTS  # noqa: E402
from tests.runtime.serve_helpers import MESSAGES, LiveServer, chat_artifact  # noqa: E402, F401

pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")

KEY = "sk-openai-client-test"


@pytest.fixture(scope="module")
def client(generator):
    config = ServeConfig(close_generator=False, api_key=KEY, model_name="tiny")
    with LiveServer(create_app(generator, config)) as live:
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            yield c


def test_completions_fields(client, generator):
    expected = generator.generate(PROMPTS[0], 6, logprobs=3, ignore_eos=True)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    (ch,) = out.choices
    assert ch.text == expected.texts[0] and ch.finish_reason == "length"
    assert ch.logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs[0]], abs=1e-6)
    assert len(ch.logprobs.tokens) == len(ch.logprobs.text_offset) == len(ch.logprobs.top_logprobs) == 6
    assert out.usage.completion_tokens == 6

    sampled = generator.generate([PROMPTS[1]] * 2, 6, do_sample=True, top_k=0, seed=3, ignore_eos=True)
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], n=2, seed=3, max_tokens=6,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == sampled.texts and [c.index for c in out.choices] == [0, 1]

    greedy = generator.generate(PROMPTS[2], 5).texts[0]
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5, temperature=0, echo=True)
    assert out.choices[0].text == PROMPTS[2] + greedy
    ids = generator.tokenizer(PROMPTS[2])["input_ids"]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].text == greedy

    penalized = generator.generate(PROMPTS[0], 12, presence_penalty=1.0, frequency_penalty=1.0).texts[0]
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    presence_penalty=1.0, frequency_penalty=1.0)
    assert out.choices[0].text == penalized

    two = generator.generate(PROMPTS[0], 8, speedup=2, ignore_eos=True)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"speedup": 2, "ignore_eos": True})
    assert out.choices[0].text == two.texts[0]
    assert out.model_extra["skipdecode"]["layers_per_token"] == two.stats.layers_per_step


def test_streamed_completions_with_usage_logprobs_and_stop(client, generator):
    full = generator.generate(PROMPTS[0], 12).texts[0]
    stop = full[3:5]
    kept = generator.generate(PROMPTS[0], 12, stop_strings=[stop]).texts[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stop=[stop], logprobs=1, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == kept[: kept.index(stop)]  # as OpenAI: the stop sequence is not returned
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices)


def test_errors_models_and_key(client, generator):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="a", logprobs=6)
    assert info.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["code"] == "no_chat_template"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="a")
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.created > 1_600_000_000
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_on_a_templated_model(chat_artifact):
    directory, tok = chat_artifact
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    gen = runtime.load(directory, threads=1)
    try:
        expected = gen.generate([ids], 8, logprobs=2, ignore_eos=True)
        with LiveServer(create_app(gen, ServeConfig(close_generator=False))) as live, \
                openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            out = c.chat.completions.create(model="model", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
            msg = out.choices[0].message
            assert msg.role == "assistant" and msg.content == expected.texts[0]
            assert [t.logprob for t in out.choices[0].logprobs.content] == pytest.approx(
                [t.logprob for t in expected.logprobs[0]], abs=1e-6)
            assert all(len(t.top_logprobs) == 2 for t in out.choices[0].logprobs.content)
            assert out.usage.prompt_tokens == len(ids)
            stream = c.chat.completions.create(model="model", messages=MESSAGES, max_completion_tokens=8,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = list(stream)
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.texts[0]
    finally:
        gen.close()
