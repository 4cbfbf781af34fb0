"""Helpers of test_serve*.py: a backend wrapper that slows, holds or fails steps on purpose, a live
uvicorn server in a thread, an SSE reader, a tiny artifact with a chat template, and (``python -m
tests.runtime.serve_helpers``) the server CLI on a slowed backend, so requests are still in flight
when the test sends SIGTERM."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time

import pytest

from runtime.backends import Backend


class SlowBackend:
    """Wraps a backend: ``delay`` seconds per step (at the head), prefills held while ``gate`` is
    clear, and a prefill whose prompt holds ``fail_token`` raises (an internal error)."""

    def __init__(self, inner, delay: float = 0.0):
        self.inner, self.delay = inner, delay
        self.gate = threading.Event()
        self.gate.set()
        self.heads = 0  # head calls: one per prefill and one per decode step
        self.fail_token: int | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def embed(self, input_ids, attention_mask):
        if input_ids.shape[1] > 1:  # a prefill (decode steps embed one token per slot)
            assert self.gate.wait(timeout=60), "the test never opened the gate"
            if self.fail_token is not None and (input_ids == self.fail_token).any():
                raise RuntimeError("injected backend failure")
        return self.inner.embed(input_ids, attention_mask)

    def head(self, hidden, rows=None):
        self.heads += 1
        if self.delay:
            time.sleep(self.delay)
        return self.inner.head(hidden, rows)

    decode = Backend.decode  # the default step, through this wrapper's embed and head


def slowed(generator, delay: float = 0.0) -> SlowBackend:
    """Put a SlowBackend under ``generator``'s engine (its only reader of the backend)."""
    generator.engine.backend = SlowBackend(generator.engine.backend, delay)
    return generator.engine.backend


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 in a thread, on a port bound before it starts."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def read_sse(lines) -> tuple[list[dict], bool]:
    """The JSON chunks of an SSE response's lines (``response.iter_lines()``, maybe partly read),
    and whether they ended with ``data: [DONE]``."""
    chunks, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        assert not done, "data after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            chunks.append(json.loads(line[len("data: "):]))
    return chunks, done


def stream_texts(chunks: list[dict]) -> tuple[dict[int, str], dict[int, str]]:
    """Text and finish_reason of each choice, from a stream's chunks."""
    texts, reasons = {}, {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"] is not None:
                assert ch["index"] not in reasons, "a choice finished twice"
                reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons


# A ChatML-like template with what real ones use: the BOS variable, a loop, raise_exception, a
# generation prompt
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations start with a system or user message') }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The Eagle?"}]


@pytest.fixture(scope="session")
def chat_artifact(checkpoint_dir, tmp_path_factory):
    """A tiny artifact whose tokenizer carries TEMPLATE, and that tokenizer (transformers')."""
    from transformers import AutoTokenizer

    from export.build import BuildOptions, build

    checkpoint = tmp_path_factory.mktemp("chat-checkpoint")
    shutil.copytree(checkpoint_dir, checkpoint, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(checkpoint)
    out = tmp_path_factory.mktemp("chat-artifact") / "model"
    build(BuildOptions(model=str(checkpoint), out=str(out), progress=False), log=lambda *_: None)
    return out, tok


def main(argv: list[str]) -> int:
    """``python -m tests.runtime.serve_helpers --delay S ARTIFACT [serve options]``."""
    import runtime
    from runtime.serve.cli import main as serve

    delay = float(argv[argv.index("--delay") + 1])
    rest = [a for i, a in enumerate(argv) if a != "--delay" and (i == 0 or argv[i - 1] != "--delay")]

    def load(*args, **kwargs):
        gen = runtime.load(*args, **kwargs)
        slowed(gen, delay)
        return gen

    return serve(rest, load=load)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
