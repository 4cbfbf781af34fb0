"""Structured output (runtime.decoding.structured, llguidance): every constrained text parses and validates
against its schema, at full depth and under a skip policy, beside free rows; the errors say what
was wrong; the server's response_format and the CLI's --json-schema reach the same path."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import runtime
from runtime.errors import InvalidArgumentError
from tests.conftest import PROMPTS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS = {
    "enum and integer range": {"type": "object", "required": ["color", "n"], "additionalProperties": False,
                               "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "n": {"type": "integer", "minimum": 3, "maximum": 9}}},
    "nested object and array": {"type": "object", "required": ["u", "t"], "additionalProperties": False,
                                "properties": {"u": {"type": "object", "required": ["id", "ok"],
                                                     "additionalProperties": False,
                                                     "properties": {"id": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99},
                                                                    "ok": {"type": "boolean"}}},
                                               "t": {"type": "array", "items": {"enum": ["a", "b"]},
                                                     "minItems": 1, "maxItems": 2}}},
    "any object": {"type": "object"},
}
NEW = 50  # enough for the schemas' documents (bounded: enums, ranges, maxLength), within the tiny models' 64 positions


@pytest.fixture(scope="module")
def gen(artifact_dir):
    g = runtime.load(artifact_dir, max_batch=4, check_hashes=False)
    yield g
    g.close()


@pytest.mark.parametrize("speedup", [None, 2])
@pytest.mark.parametrize("name", ["enum and integer range", "nested object and array"])
def test_every_constrained_text_validates(gen, name, speedup):
    schema = SCHEMAS[name]
    result = gen.generate(PROMPTS, NEW, json_schema=schema, speedup=speedup)
    for text, reason in zip(result.texts, result.finish_reasons):
        assert reason == "stop", (text, reason)  # the document completed: the row ended there
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", ["enum and integer range", "nested object and array"])
def test_lossless_rows_keep_the_schema(gen, name):
    """A lossless row's drafts are unconstrained proposals; the verify pass judges each against the
    mask at its position (runtime.engine.output.emit_step): full depth's constrained tokens, exactly; sampled
    rows still validate."""
    schema = SCHEMAS[name]
    want = gen.generate(PROMPTS, NEW, json_schema=schema)
    got = gen.generate(PROMPTS, NEW, json_schema=schema, speedup=3, lossless=True)
    assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons
    assert got.stats.verify_passes > 0
    sampled = gen.generate(PROMPTS, NEW, json_schema=schema, speedup=3, lossless=True, do_sample=True, seed=5)
    for text in sampled.texts:
        jsonschema.validate(json.loads(text), schema)


def test_sampled_rows_validate_too(gen):
    schema = {"type": "object", "required": ["word"], "additionalProperties": False,
              "properties": {"word": {"type": "string", "maxLength": 12}}}
    result = gen.generate(PROMPTS, NEW, json_schema=json.dumps(schema), do_sample=True, seed=3, top_k=0)
    for text in result.texts:
        jsonschema.validate(json.loads(text), schema)


def test_constrained_and_free_requests_share_the_batch(gen):
    alone = gen.generate(PROMPTS[:1], 12, ignore_eos=True)
    free = gen.stream(PROMPTS[:1], 12, ignore_eos=True)
    constrained = gen.stream(PROMPTS[1:3], NEW, json_schema=SCHEMAS["enum and integer range"])
    for _ in constrained:
        pass
    for _ in free:
        pass
    assert free.result.token_ids == alone.token_ids  # a free row beside constrained ones: unchanged
    for text in constrained.result.texts:
        jsonschema.validate(json.loads(text), SCHEMAS["enum and integer range"])


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, "json_schema cannot be compiled: "),
    ("{not json", "json_schema is not valid JSON: "),
    ([1, 2], "json_schema must be a JSON schema (an object), got list"),
])
def test_a_bad_schema_is_refused_before_any_work(gen, schema, message):
    with pytest.raises(InvalidArgumentError) as err:
        gen.generate(PROMPTS[0], 4, json_schema=schema)
    assert str(err.value).startswith(message)


def test_without_llguidance_the_error_names_the_extra(gen, monkeypatch):
    from runtime.decoding.structured import Structured

    monkeypatch.setitem(sys.modules, "llguidance", None)
    fresh = Structured(gen.structured.tokenizer_json, gen.structured.vocab_size, gen.structured.eos_ids)
    with pytest.raises(InvalidArgumentError, match=r"json_schema needs llguidance.*pip install 'skipdecode-edge\[json\]'"):
        fresh.compile({"type": "object"})


def test_the_cli_takes_a_schema_file(artifact_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["enum and integer range"]))
    done = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), PROMPTS[0], "--json-schema",
                           str(schema), "--max-new-tokens", str(NEW), "--no-check-hashes", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(json.loads(done.stdout)["text"]), SCHEMAS["enum and integer range"])
    done = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "x", "--json-schema", "nosuch.json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: --json-schema 'nosuch.json' is neither a JSON object nor a file; pass the schema inline "
        "('{\"type\": \"object\"}') or the path of a .json file")
    # a schema llguidance cannot compile (its regex error spans three lines): one error line, as the docs promise
    bad = json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}})
    done = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "x", "--json-schema", bad,
                           "--no-check-hashes"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: json_schema cannot be compiled: regex parse error:") and "unclosed group" in line


# -- the server's response_format ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(gen):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from runtime.serve import ServeConfig, create_app
    from tests.runtime.serve_helpers import LiveServer

    with LiveServer(create_app(gen, ServeConfig(close_generator=False))) as live:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield client


@pytest.mark.parametrize("fmt, schema", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["enum and integer range"]}},
     SCHEMAS["enum and integer range"]),
    ({"type": "json_object"}, {"type": "object"}),
])
def test_response_format_constrains_every_choice(server, gen, fmt, schema):
    # json_object: any object; a random model might nest for long, so its text is checked as far as it got
    r = server.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": NEW, "temperature": 0,
                                             "response_format": fmt})
    assert r.status_code == 200, r.text
    expected = gen.generate(PROMPTS[:2], NEW, json_schema=schema)
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == expected.texts  # the API's path is the Python API's
    for c in choices:
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["text"]), schema)
        else:
            assert fmt["type"] == "json_object" and c["text"].startswith("{")


def test_a_json_answer_cut_short_says_so_and_none_asked_gets_room(server, gen):
    """OpenAI's convention: finish_reason "length" on a JSON answer means it may not parse; the
    response says so in words, and a request without max_tokens gets room for a document rather
    than the 16 tokens of a text completion."""
    schema = SCHEMAS["enum and integer range"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = server.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                               "response_format": fmt}).json()
    assert out["choices"][0]["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(out["choices"][0]["text"])
    assert out["skipdecode"]["warnings"] == [
        'choice 0: max_tokens (3) ended its JSON before the document did, so it does not parse (finish_reason '
        '"length"); ask for more max_tokens']
    out = server.post("/v1/completions", json={"prompt": PROMPTS[0], "temperature": 0, "response_format": fmt}).json()
    assert out["choices"][0]["finish_reason"] == "stop" and "warnings" not in out["skipdecode"]
    jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)
    assert out["usage"]["completion_tokens"] > 16  # the document needed more than a text completion's default
    # free text keeps OpenAI's default of 16
    out = server.post("/v1/completions", json={"prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "xml"}, "response_format", 'response_format must be {"type": "text"}, {"type": "json_object"} or'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema",
     'must be an object with a "schema" object'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "response_format",
     "json_schema cannot be compiled: "),
])
def test_bad_response_formats_get_a_400_that_says_why(server, fmt, param, words):
    r = server.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_response_format_text_is_free_text(server, gen):
    r = server.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True, "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == gen.generate(PROMPTS[0], 6, ignore_eos=True).texts[0]


def test_greedy_rows_skip_the_mask_exactly_when_their_argmax_is_allowed(gen, monkeypatch):
    """Greedy decoding checks its argmax against the grammar before computing a mask: the same
    tokens as masking every step, and most steps compute none."""
    from runtime.decoding.structured import RowMatcher

    schema = {"type": "string", "maxLength": 24}  # inside a string most of a random model's argmaxes are allowed
    lazy = gen.generate(PROMPTS, NEW, json_schema=schema)
    calls = []
    mask = RowMatcher.mask
    monkeypatch.setattr(RowMatcher, "mask", lambda self, logits: calls.append(1) or mask(self, logits))
    gen.generate(PROMPTS, NEW, json_schema=schema)
    steps = sum(len(ids) for ids in lazy.token_ids)
    assert 0 < len(calls) < steps / 2  # the opening quote needs a mask; most of the string did not
    monkeypatch.setattr(RowMatcher, "allows", lambda self, token: False)  # mask every step
    assert gen.generate(PROMPTS, NEW, json_schema=schema).token_ids == lazy.token_ids
