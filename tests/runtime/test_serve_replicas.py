"""python -m runtime serve --replicas 2: the same API from two Ray Serve replicas, through Ray's
HTTP proxy, and what a replica's death costs. One Ray instance for the module (it takes ~20 s to
start on 2 cores): the CLI in a subprocess, as a user runs it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve")

from tests.conftest import PROMPTS  # noqa: E402
from tests.runtime.serve_helpers import read_sse, stream_texts  # noqa: E402
from tools.bench.server_load import fault_run, free_port, replica_pids, stop_server, wait_healthy  # noqa: E402

pytestmark = pytest.mark.parametrize("checkpoint_dir", ["pre_ln"], indirect=True, scope="session")

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-replicas-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 60


@pytest.fixture(scope="module")
def replicas(artifact_dir):
    """The CLI serving ``artifact_dir`` from 2 replicas of 1 thread each on --port 0 (any free port:
    the URL is the one it prints); yields (url, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "serve", str(artifact_dir), "--replicas", "2", "--threads", "1",
         "--port", "0", "--max-batch", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "SKIPDECODE_API_KEY": KEY})
    watchdog = threading.Timer(240, proc.kill)  # a start that never prints its URL ends the read below
    watchdog.start()
    seen, url = [], None
    for line in proc.stdout:
        seen.append(line)
        if m := re.search(r" on (http://127\.0\.0\.1:\d+)", line):
            url = m.group(1)
            break
    watchdog.cancel()
    proc.printed = seen  # what the fixture read of its output, up to the URL
    try:
        try:
            assert url is not None and not url.endswith(":0"), "".join(seen)
            wait_healthy(url, proc, timeout=240)
        except RuntimeError as exc:
            pytest.fail(f"{exc}: {proc.stdout.read() if proc.poll() is not None else ''}")
        yield url, proc
    finally:
        if proc.poll() is None:
            stop_server(proc)  # SIGTERM first: the CLI then stops the Ray instance it started


def _complete(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_replicas_answer_as_one_server(replicas, generator):
    url, _ = replicas
    with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as c:
        for prompt in PROMPTS:
            expected = generator.generate(prompt, 8, speedup=2, logprobs=1)
            body = _complete(c, prompt=prompt, max_tokens=8, temperature=0, speedup=2, logprobs=1)
            assert body["choices"][0]["text"] == expected.texts[0]
            assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
                [t.logprob for t in expected.logprobs[0]], abs=1e-5)
            with c.stream("POST", "/v1/completions", json=dict(prompt=prompt, max_tokens=8, temperature=0,
                                                               speedup=2, stream=True)) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                chunks, done = read_sse(r.iter_lines())
            assert done and stream_texts(chunks)[0] == {0: expected.texts[0]}
            assert len(chunks) >= 2  # streamed through Ray's proxy chunk by chunk, not as one body
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        assert c.get("/v1/models").json()["data"][0]["id"] == Path(generator.directory).name
        assert "skipdecode_requests_total" in c.get("/metrics").text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi"}, timeout=TIMEOUT)  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_two_replica_processes_share_the_load(replicas, generator):
    url, _ = replicas
    assert len(replica_pids()) == 2
    expected = generator.generate(PROMPTS[1], 10, ignore_eos=True).texts[0]

    def one(_):
        with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as c:
            return _complete(c, prompt=PROMPTS[1], max_tokens=10, temperature=0, ignore_eos=True)["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(32))) == [expected] * 32


def test_a_dead_replica_fails_only_its_requests_and_comes_back(replicas):
    url, _ = replicas
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    before = replica_pids()
    result = asyncio.run(fault_run(url, ["Hello", "Paris is", "The quick brown"], clients=8, duration=8,
                                   kill_after=3, timeout=30, body=body, headers=AUTH))
    assert result.killed in before
    out = result.outcomes
    assert out.get(("before", "lost"), 0) == 0 and out.get(("after", "lost"), 0) == 0, result  # nothing hangs
    assert out.get(("after", "failed"), 0) == 0, result  # the others are unaffected
    assert out.get(("before", "failed"), 0) <= result.in_flight, result  # only requests in flight can fail
    assert out.get(("after", "completed"), 0) > 0, result
    # what a request in flight on the dead replica gets: an OpenAI error (503, or in its stream)
    assert all("the replica serving this request stopped" in e for e in result.errors), result.errors
    deadline = time.monotonic() + 90
    while len(replica_pids()) < 2:  # Ray restarts it
        assert time.monotonic() < deadline, "Ray did not restart the replica"
        time.sleep(1)


def test_sigterm_shuts_the_replicas_down_and_exits_0(replicas):
    url, proc = replicas
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    out = "".join(proc.printed) + proc.stdout.read()
    assert "from 2 replica(s) on Ray Serve" in out and "Shutting down" in out and KEY not in out, out
    assert "Traceback" not in out, out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


@pytest.mark.parametrize("args, words", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--port", "99999"], "--port must be in [0, 65535]"),
    (["--replicas", "2", "--speedup", "99"], "--speedup"),
])
def test_replica_cli_errors_come_before_ray(artifact_dir, capsys, args, words):
    from runtime.serve.cli import main

    assert main([str(artifact_dir), *args]) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and words in err and "serving" not in out


def test_the_documented_config_file_builds_the_application(artifact_dir):
    """docs/serving.md's YAML: its args are build_app's (its directory here: the test artifact), its
    deployment name is ours."""
    import re

    import yaml

    from runtime.serve.replicas import DEPLOYMENT, build_app

    text = (REPO / "docs" / "serving.md").read_text()
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    (app,) = config["applications"]
    assert app["import_path"] == "runtime.serve.replicas:build_app"
    assert app["deployments"][0]["name"] == DEPLOYMENT
    built = build_app({**app["args"], "directory": str(artifact_dir)})
    deployment = built._bound_deployment
    assert deployment.name == DEPLOYMENT and deployment.num_replicas == 2
    assert deployment.ray_actor_options == {"num_cpus": 1, "num_gpus": 0}
