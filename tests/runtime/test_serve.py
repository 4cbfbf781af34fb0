"""python -m runtime serve: a live server on 127.0.0.1 queried over real HTTP with httpx."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import runtime  # noqa: E402
from runtime.serve import ServeConfig, create_app  # noqa: E402
from tests.conftest import PROMPTS  # noqa: E402
from tests.runtime.serve_helpers import LiveServer, read_sse, slowed, stream_texts  # noqa: E402
from tests.runtime.test_engine import Picks  # noqa: E402

# One model variant is enough here: the HTTP layer does not depend on it (test_generate covers both).
pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60  # seconds for any one HTTP exchange; a hang fails instead of stalling CI


@pytest.fixture(scope="module")
def server(generator):
    """The shared test Generator (max_batch 8) served; the fixture, not the server, closes it."""
    with LiveServer(create_app(generator, ServeConfig(close_generator=False))) as live:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as client:
            yield client


@pytest.fixture(scope="module")
def slow(artifact_dir):
    """One KV slot, one waiting request, 30 ms per step: requests stay in flight long enough to
    disconnect from, and the queue fills on demand. Yields (client, SlowBackend, generator)."""
    gen = runtime.load(artifact_dir, threads=1, max_batch=1, max_queue=1)
    backend = slowed(gen, delay=0.03)
    try:
        with LiveServer(create_app(gen, ServeConfig(close_generator=False))) as live:
            with httpx.Client(base_url=live.url, timeout=TIMEOUT) as client:
                yield client, backend, gen
    finally:
        backend.gate.set()
        gen.close(cancel=True)


def complete(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def complete_streaming(client, **body):
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks, done = read_sse(r.iter_lines())
    assert done, "the stream did not end with data: [DONE]"
    return chunks


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- equal to runtime.generate ---------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9, seed=7),
], ids=["greedy", "sampled"])
def test_responses_equal_generate(server, generator, sampling):
    kwargs = dict(do_sample=False) if sampling["temperature"] == 0 else dict(
        do_sample=True, temperature=0.8, top_p=0.9, top_k=0, seed=7)
    for prompt in PROMPTS:
        expected = generator.generate(prompt, 10, speedup=2, **kwargs)
        body = complete(server, prompt=prompt, max_tokens=10, speedup=2, **sampling)
        (ch,) = body["choices"]
        assert ch["text"] == expected.texts[0]
        assert ch["finish_reason"] == ("length" if expected.finish_reasons[0] == "length" else "stop")
        prompt_tokens = len(generator.tokenizer(prompt)["input_ids"])
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(expected.token_ids[0]),
                                 "total_tokens": prompt_tokens + len(expected.token_ids[0]),
                                 "prompt_tokens_details": {"cached_tokens": 0}}  # the shared generator keeps none
        assert body["skipdecode"]["layers_per_token"] == expected.stats.layers_per_step
        assert body["skipdecode"]["layer_reduction"] == pytest.approx(expected.stats.layer_reduction, abs=1e-3)
        assert body["skipdecode"]["policy"] == expected.policy.to_dict()
        assert "theoretical_speedup" not in body["skipdecode"]  # a layer count, not a speed
        t = body["timings"]  # llama.cpp server's fields: what this request waited
        assert t["prompt_n"] == prompt_tokens and t["predicted_n"] == len(expected.token_ids[0])
        assert 0 < t["first_token_ms"] <= t["total_ms"] and t["prompt_ms"] + t["predicted_ms"] <= t["total_ms"]
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / (t["predicted_n"] - 1), rel=1e-2)
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")

        chunks = complete_streaming(server, prompt=prompt, max_tokens=10, speedup=2,
                                    stream_options={"include_usage": True}, **sampling)
        texts, reasons = stream_texts(chunks)
        assert texts == {0: expected.texts[0]} and reasons == {0: ch["finish_reason"]}
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
        assert chunks[-1]["skipdecode"] == body["skipdecode"] and set(chunks[-1]["timings"]) == set(t)


def test_greedy_answers_ask_the_backend_for_token_ids_only(server, generator):
    """The server's events carry no logits: a greedy request's steps ask the backend for its rows'
    argmax (on a GPU picked there, runtime.backends.base), streamed or whole; a sampled one's do not."""
    picks = Picks(generator.engine.backend)
    try:
        complete_streaming(server, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        complete(server, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        asked = [a for call, a, _, _ in picks.calls if call == "decode"]
        assert asked and all(asked)
        picks.calls.clear()
        complete_streaming(server, prompt=PROMPTS[0], max_tokens=6, temperature=0.8, seed=1)
        asked = [a for call, a, _, _ in picks.calls if call == "decode"]
        assert asked and not any(asked)
    finally:
        picks.stop()


def test_prompt_list_is_one_batch(server, generator):
    """A list of prompts is one engine request: as runtime.generate with the same list."""
    expected = generator.generate(PROMPTS, 6, policy={"max_layers": 5, "min_layers": 3})
    body = complete(server, prompt=PROMPTS, max_tokens=6, temperature=0,
                    policy={"max_layers": 5, "min_layers": 3})
    assert [c["text"] for c in body["choices"]] == expected.texts
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts, reasons = stream_texts(complete_streaming(server, prompt=PROMPTS, max_tokens=6, temperature=0,
                                                     policy={"max_layers": 5, "min_layers": 3}))
    assert [texts[i] for i in range(3)] == expected.texts and set(reasons) == {0, 1, 2}


def test_stop_sequence_is_left_out_as_openai(server, generator):
    """The runtime keeps the stop string (as transformers); the server cuts it, streamed or not,
    and never streams a piece of it."""
    full = generator.generate(PROMPTS[0], 12).texts[0]
    stop = full[3:5]
    assert len(stop) == 2, f"greedy text too short to pick a stop string from: {full!r}"
    kept = generator.generate(PROMPTS[0], 12, stop_strings=[stop]).texts[0]
    assert stop in kept
    before = kept[: kept.index(stop)]
    body = complete(server, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop)
    assert body["choices"][0]["text"] == before
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = complete_streaming(server, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert stream_texts(chunks) == ({0: before}, {0: "stop"})


def test_logprobs_as_openai_from_the_runtimes_log_softmax(server, generator):
    expected = generator.generate(PROMPTS[0], 6, logprobs=2, ignore_eos=True)
    body = complete(server, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    (ch,) = body["choices"]
    lp = ch["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in expected.logprobs[0]], abs=1e-6)
    assert lp["tokens"] == [generator.tokenizer.decode([i]) for i in expected.token_ids[0]]
    for tok, top, t in zip(lp["tokens"], lp["top_logprobs"], expected.logprobs[0]):
        assert top[tok] == pytest.approx(t.logprob)  # the chosen token is always there
        assert max(top.values()) == pytest.approx(t.top[0][1]) and len(top) <= 3
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] <= len(ch["text"])
    chunks = complete_streaming(server, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                ignore_eos=True)
    streamed = {k: [v for c in chunks for ch in c["choices"] for v in ch["logprobs"][k]] for k in lp}
    assert streamed == lp


def test_n_choices_each_with_its_own_random_stream(server, generator):
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, seed=11)
    expected = generator.generate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, 8, ignore_eos=True, **sampling)
    assert expected.texts[0] != expected.texts[1], "two rows of the same prompt drew the same tokens"
    body = complete(server, prompt=PROMPTS[:2], n=2, max_tokens=8, seed=11, ignore_eos=True)
    assert [c["text"] for c in body["choices"]] == expected.texts
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    prompt_tokens = sum(len(generator.tokenizer(p)["input_ids"]) for p in PROMPTS[:2])
    assert body["usage"]["prompt_tokens"] == prompt_tokens  # each prompt once, as OpenAI
    assert body["usage"]["completion_tokens"] == 4 * 8
    texts, _ = stream_texts(complete_streaming(server, prompt=PROMPTS[:2], n=2, max_tokens=8, seed=11,
                                               ignore_eos=True))
    assert [texts[i] for i in range(4)] == expected.texts


def test_echo_and_token_id_prompts(server, generator):
    expected = generator.generate(PROMPTS[:2], 5).texts
    body = complete(server, prompt=PROMPTS[:2], max_tokens=5, temperature=0, echo=True)
    assert [c["text"] for c in body["choices"]] == [p + t for p, t in zip(PROMPTS, expected)]
    texts, _ = stream_texts(complete_streaming(server, prompt=PROMPTS[:2], max_tokens=5, temperature=0, echo=True))
    assert [texts[0], texts[1]] == [p + t for p, t in zip(PROMPTS, expected)]
    ids = [generator.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    body = complete(server, prompt=ids, max_tokens=5, temperature=0)
    assert [c["text"] for c in body["choices"]] == expected
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    single = complete(server, prompt=ids[0], max_tokens=5, temperature=0)  # one prompt as a list of ids
    assert single["choices"][0]["text"] == expected[0]


def test_penalties_reach_the_sampler(server, generator):
    expected = generator.generate(PROMPTS[0], 16, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    body = complete(server, prompt=PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True,
                    frequency_penalty=1.5, presence_penalty=0.5)
    assert body["choices"][0]["text"] == expected.texts[0]
    assert expected.texts[0] != generator.generate(PROMPTS[0], 16, ignore_eos=True).texts[0]


# -- under load ----------------------------------------------------------------------------------------


def test_32_concurrent_clients_half_streaming(server, generator):
    cases = [(PROMPTS[i % 3], 4 + i % 5, [1, 2, 3][i % 3]) for i in range(32)]
    expected = {c: generator.generate(c[0], c[1], speedup=c[2]).texts[0] for c in set(cases)}

    def client(i):
        prompt, max_tokens, speedup = cases[i]
        body = dict(prompt=prompt, max_tokens=max_tokens, speedup=speedup, temperature=0)
        with httpx.Client(base_url=str(server.base_url), timeout=TIMEOUT) as c:
            if i % 2:
                texts, reasons = stream_texts(complete_streaming(c, **body))
                return texts.get(0), reasons.get(0)
            ch = complete(c, **body)["choices"][0]
            return ch["text"], ch["finish_reason"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    for case, (text, reason) in zip(cases, results):
        assert text == expected[case], case
        assert reason in ("stop", "length")
    health = server.get("/health").json()
    assert health["running"] == 0 and health["waiting"] == 0


def test_internal_error_fails_only_its_request(server, generator):
    """A backend failure in one request's prefill answers that request 500 (or an error event
    in its stream) and leaves the concurrent ones and the server intact."""
    poison = "Paris Paris"
    backend = slowed(generator)
    backend.fail_token = generator.tokenizer(poison)["input_ids"][-1]
    good = PROMPTS[1]
    assert backend.fail_token not in generator.tokenizer(good)["input_ids"]
    try:
        expected = None
        with ThreadPoolExecutor(4) as pool:
            bad = pool.submit(server.post, "/v1/completions", json=dict(prompt=poison, max_tokens=4))
            bad_stream = pool.submit(complete_streaming, server, prompt=poison, max_tokens=4)
            goods = [pool.submit(complete, server, prompt=good, max_tokens=6, temperature=0) for _ in range(2)]
            r = bad.result()
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "server_error" and "injected backend failure" in err["message"]
            chunks = bad_stream.result()
            assert "injected backend failure" in chunks[-1]["error"]["message"]
            texts = [g.result()["choices"][0]["text"] for g in goods]
    finally:
        generator.engine.backend = backend.inner
    expected = generator.generate(good, 6).texts[0]
    assert texts == [expected, expected]
    assert server.get("/health").json()["status"] == "ok"


def test_disconnect_mid_stream_frees_the_slot(slow):
    client, backend, gen = slow
    start = backend.heads
    with client.stream("POST", "/v1/completions",
                       json=dict(prompt="Hello", max_tokens=40, ignore_eos=True, stream=True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the first token arrived: the request runs
    # 40 steps take >= 1.2 s; the slot (there is one) must be free long before that
    t0 = time.monotonic()
    wait_for(lambda: client.get("/health").json()["running"] == 0, what="the engine to drop the request")
    body = complete(client, prompt="Paris", max_tokens=2, temperature=0)
    assert body["usage"]["completion_tokens"] == 2
    assert time.monotonic() - t0 < 1.0
    assert backend.heads - start < 30, "the disconnected request kept decoding"


def test_disconnect_while_waiting_for_a_whole_response(slow):
    client, backend, _ = slow
    start = backend.heads
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json=dict(prompt="Hello", max_tokens=40, ignore_eos=True), timeout=0.3)
    wait_for(lambda: client.get("/health").json()["running"] == 0, timeout=2,
             what="the engine to drop the abandoned request")
    assert backend.heads - start < 30


def _gauge(client, name) -> float:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_queue_full_answers_503_with_retry_after(slow):
    client, backend, _ = slow
    backend.gate.clear()  # prefills wait: the first request holds the one slot, the next waits
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(complete, client, prompt="Hello", max_tokens=3, temperature=0)
            wait_for(lambda: client.get("/health").json()["running"] == 1, what="the first request to run")
            second = pool.submit(complete_streaming, client, prompt="Paris", max_tokens=3, temperature=0)
            wait_for(lambda: client.get("/health").json()["waiting"] == 1, what="the second to wait")
            assert _gauge(client, "skipdecode_queue_depth") == 1 and _gauge(client, "skipdecode_running_rows") == 1
            r = client.post("/v1/completions", json=dict(prompt="third", max_tokens=3))
            assert r.status_code == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            assert "--max-queue 1" in r.json()["error"]["message"] and "--max-batch 1" in r.json()["error"]["message"]
            backend.gate.set()
            assert first.result()["usage"]["completion_tokens"] == 3
            assert stream_texts(second.result())[1] == {0: "length"}
    finally:
        backend.gate.set()
    assert complete(client, prompt="again", max_tokens=2)["usage"]["completion_tokens"] == 2


# -- bad requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": [1, 10 ** 7]}, 400, "prompt"),  # outside the vocabulary
    ({"prompt": ["a"] * 9}, 400, "prompt"),  # more than max_batch 8
    ({"prompt": ["a", "b"], "n": 5}, 400, "n"),  # 10 rows, more than max_batch 8
    ({"prompt": "a", "n": 0}, 400, "n"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 100}, 400, "max_tokens"),  # beyond max_position_embeddings 64
    ({"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_k": -1}, 400, "top_k"),
    ({"prompt": "a", "seed": 1.5}, 400, "seed"),
    ({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, 400, "stop"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "logprobs": 6}, 400, "logprobs"),  # OpenAI's limit is 5
    ({"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "a", "logprobs": 1, "echo": True}, 400, "echo"),
    ({"prompt": "a", "echo": 1}, 400, "echo"),
    ({"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": "high"}, 400, "frequency_penalty"),
    ({"prompt": "a", "max_completion_tokens": 4}, 400, "max_completion_tokens"),  # chat's name, as OpenAI
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a", "speedup": 0.5}, 400, "speedup"),
    ({"prompt": "a", "speedup": 99}, 400, "speedup"),
    ({"prompt": "a", "speedup": 2, "policy": {"max_layers": 4, "min_layers": 2}}, 400, "speedup"),
    ({"prompt": "a", "policy": {"max_layers": 99, "min_layers": 2}}, 400, "policy.max_layers"),
    ({"prompt": "a", "policy": {"max_layers": 4, "min_layers": 5}}, 400, "policy.min_layers"),
    ({"prompt": "a", "policy": {"max_layers": 4}}, 400, "policy.min_layers"),
    ({"prompt": "a", "policy": {"max_layers": 4, "min_layers": 2, "depth": 1}}, 400, "policy.depth"),
    ({"prompt": "a", "max_token": 4}, 400, "max_token"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
])
def test_bad_request_names_the_field(server, body, status, param):
    if isinstance(body, bytes):
        r = server.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    if param:
        assert param.split(".")[-1] in err["message"]


def test_models_health_and_no_chat(server, generator):
    models = server.get("/v1/models").json()
    (card,) = models["data"]
    assert card["object"] == "model" and card["skipdecode"]["num_layers"] == generator.num_layers
    assert card["created"] == int((Path(generator.directory) / "manifest.json").stat().st_mtime) > 0
    assert server.get(f"/v1/models/{card['id']}").status_code == 200
    assert complete(server, prompt="Hi", max_tokens=1, model=card["id"])["model"] == card["id"]
    assert server.get("/health").json()["status"] == "ok"
    r = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "no_chat_template" and err["param"] == "messages"
    assert "has no chat template" in err["message"] and "use /v1/completions" in err["message"]
    assert server.get("/v1/nothing").json()["error"]["type"] == "invalid_request_error"


def test_api_key_and_cors_only_when_asked(generator, server):
    key = "sk-test-0123456789"
    config = ServeConfig(close_generator=False, api_key=key, allowed_origins=["https://app.example"])
    assert key not in repr(config)
    with LiveServer(create_app(generator, config)) as live, httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        body = dict(prompt="Hi", max_tokens=1)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key" and key not in r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}",
                                                           "Origin": "https://app.example"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert c.get("/health").status_code == 200  # probes need no key
        pre = c.options("/v1/completions", headers={"Origin": "https://app.example",
                                                    "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and "POST" in pre.headers["access-control-allow-methods"]
    # the shared server was started without --allowed-origins: no CORS headers
    r = server.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_lossless_requests_get_full_depths_text_and_their_counts(generator):
    """The ``lossless`` extension field: full depth's greedy text at a 2x draft policy, the drafts'
    counts in the response's skipdecode object and in /metrics; a non-boolean is a 400."""
    from prometheus_client.parser import text_string_to_metric_families

    prompt = PROMPTS[1]
    expected = generator.generate(prompt, 12, ignore_eos=True)
    with LiveServer(create_app(generator, ServeConfig(close_generator=False))) as live, \
            httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        out = complete(c, prompt=prompt, max_tokens=12, temperature=0, speedup=2, lossless=True, ignore_eos=True)
        bad = c.post("/v1/completions", json=dict(prompt=prompt, lossless="yes"))
        metrics = c.get("/metrics").text
    assert out["choices"][0]["text"] == expected.texts[0]
    info = out["skipdecode"]["lossless"]
    assert info["verify_passes"] > 0 and 0 <= info["accepted_tokens"] <= info["drafted_tokens"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lossless"
    samples = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert samples["skipdecode_lossless_drafted_tokens_total"] == info["drafted_tokens"]
    assert samples["skipdecode_lossless_accepted_tokens_total"] == info["accepted_tokens"]
    assert samples["skipdecode_lossless_verify_passes_total"] == info["verify_passes"]


def test_metrics_count_what_was_served(generator, monkeypatch):
    """And a whole answer's handler is sent no event per step (its token times are the engine's),
    a stream's one per step."""
    from prometheus_client.parser import text_string_to_metric_families

    prompt = PROMPTS[1]
    expected = generator.generate(prompt, 5, speedup=2, ignore_eos=True)
    submitted, submit = [], generator.engine.submit
    monkeypatch.setattr(generator.engine, "submit", lambda request, *a, **k: submitted.append(request) or
                        submit(request, *a, **k))
    with LiveServer(create_app(generator, ServeConfig(close_generator=False))) as live, \
            httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        body = dict(prompt=prompt, max_tokens=5, temperature=0, speedup=2, ignore_eos=True)
        assert complete(c, **body)["choices"][0]["text"] == expected.texts[0]
        assert stream_texts(complete_streaming(c, **body))[0] == {0: expected.texts[0]}
        assert c.post("/v1/completions", json=dict(prompt="a", top_k=-1)).status_code == 400
        assert c.get("/nowhere").status_code == 404
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(r.text) for s in family.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("skipdecode_requests_total", endpoint="/v1/completions", status="200") == 2
    assert value("skipdecode_requests_total", endpoint="/v1/completions", status="400") == 1
    assert value("skipdecode_requests_total", endpoint="other", status="404") == 1
    assert value("skipdecode_prompt_tokens_total") == 2 * len(generator.tokenizer(prompt)["input_ids"])
    assert value("skipdecode_generation_tokens_total") == 10
    assert value("skipdecode_time_to_first_token_seconds_count") == 2
    assert value("skipdecode_inter_token_latency_seconds_count") == 8
    assert [r.streams for r in submitted[:2]] == [False, True] and len(submitted[0].step_times) == 5
    layers = expected.stats.layers_per_step
    assert value("skipdecode_layers_per_token_count", speedup="2") == 2 * len(layers)
    assert value("skipdecode_layers_per_token_sum", speedup="2") == 2 * sum(layers)
    assert value("skipdecode_queue_depth") == 0 and value("skipdecode_running_rows") == 0


# -- the command line ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_requests_in_flight_then_exits_0(artifact_dir, generator):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.serve_helpers", "--delay", "0.05", str(artifact_dir),
         "--port", str(port), "--threads", "1", "--max-batch", "4", "--device", "cpu"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "SKIPDECODE_API_KEY": API_KEY})
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=90, what="the server to start")
        started = threading.Barrier(4 + 1, timeout=TIMEOUT)

        def client(i):
            body = dict(prompt=PROMPTS[i % 3], max_tokens=20, ignore_eos=True, temperature=0, stream=True)
            with httpx.Client(timeout=TIMEOUT, headers=auth) as c, \
                    c.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(lines)
                started.wait()
                chunks, done = read_sse(lines)
            chunks.insert(0, json.loads(first[len("data: "):]))
            return chunks, done

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client, i) for i in range(4)]
            started.wait()  # every request has its first token: 19 steps of 50 ms each remain
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.TransportError):  # no longer accepting
                httpx.get(f"{url}/health", timeout=2)
            for i, f in enumerate(futures):
                chunks, done = f.result()
                assert done
                expected = generator.generate(PROMPTS[i % 3], 20, ignore_eos=True).texts[0]
                assert stream_texts(chunks) == ({0: expected}, {0: "length"})  # every token arrived
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "Shutting down" in out and "Traceback" not in out, out
        assert "(API key required)" in out and "POST /v1/completions" in out  # the access log ran
        assert API_KEY not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


API_KEY = "sk-never-logged-4242"


def _one_error_line(capsys, *words) -> None:
    out, err = capsys.readouterr()
    assert "serving" not in out and len(err.splitlines()) == 1 and err.startswith("error: "), (out, err)
    for word in words:
        assert word in err, err


def test_cli_explains_bad_speedup(artifact_dir, capsys):
    from runtime.serve.cli import main

    assert main([str(artifact_dir), "--speedup", "99", "--port", "0"]) == 2
    _one_error_line(capsys, "--speedup")


@pytest.mark.parametrize("args, words", [
    (["--port", "99999"], ["--port must be in [0, 65535], got 99999"]),
    (["--port", "0", "--host", "no-such-host.invalid"], ["--host 'no-such-host.invalid'", "127.0.0.1"]),
    (["--port", "0", "--host", "192.0.2.1"], ["cannot listen on 192.0.2.1:0"]),  # not this machine's
    (["--port", "0", "--engine-dir", "x"], ["--engine-dir applies only to --backend tensorrt"]),
    (["--port", "0", "--max-batch", "0"], ["--max-batch must be >= 1"]),
    (["--port", "0", "--prefix-cache-mb", "-1"], ["--prefix-cache-mb must be >= 0 (0 turns prompt reuse off), got -1"]),
    (["--port", "0", "--device", "cuda:7"], ["cuda"]),  # no such device here: the backend says so
])
def test_cli_startup_errors_are_one_line(artifact_dir, capsys, args, words):
    from runtime.serve.cli import main

    assert main([str(artifact_dir), *args]) == 2
    _one_error_line(capsys, *words)


def test_cli_port_in_use_is_one_line_and_never_claims_to_serve(artifact_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "runtime", "serve", str(artifact_dir), "--port", str(port)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "serving" not in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                                        f"another process listens there: pick another --port, or stop that process"]



def test_help_never_shows_the_api_key(monkeypatch, checkpoint_dir):
    from runtime.serve.cli import parser

    monkeypatch.setenv("SKIPDECODE_API_KEY", API_KEY)
    assert API_KEY not in parser().format_help()
