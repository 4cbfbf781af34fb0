"""``python -m runtime serve``'s options, shared by its two modes: one process (serve/cli.py) and
Ray Serve replicas (serve/replicas.py). The parser, the checks that need no model, and the listening
socket, bound before anything loads so that a port in use is one line and not a traceback."""

from __future__ import annotations

import argparse
import os
import socket

from .. import cli
from ..backends import BACKENDS
from ..errors import SkipDecodeError
from ..generator import DEFAULT_PREFILL_CHUNK

API_KEY_ENV = "SKIPDECODE_API_KEY"  # --api-key's default, so that the key need not be on a command line


def parser() -> argparse.ArgumentParser:
    p = cli.parser(  # --version, defaults in --help, as every CLI of the toolkit
        "python -m runtime serve",
        "Serve an exported artifact over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions when the tokenizer has a chat template, /v1/models, /health, /metrics). "
        "Concurrent requests are batched by the engine, each with its own SkipDecode policy; "
        "--replicas N serves from N engines on Ray Serve.")
    p.add_argument("directory", help="artifact directory written by `python -m export build`")
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    http.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    # no default here: --help would print the key of the environment
    http.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
                                        f"unset: no key); /health and /metrics stay open")
    http.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                      help="answer CORS for these browser origins ('*' for any); default: no CORS headers")
    http.add_argument("--model-name", help="model id in /v1/models and responses (default: the directory's name)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds SIGTERM waits for requests in flight before cancelling them")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    http.add_argument("--no-access-log", action="store_true", help="do not log every request")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-batch", type=int,
                     help="rows decoded together: KV rows (default 8, or the backend's limit if lower); "
                          "a step costs the rows that run, not the rows it could hold")
    cli.add_prefill_chunk(eng, DEFAULT_PREFILL_CHUNK)
    cli.add_batch_invariant(eng)
    eng.add_argument("--max-queue", type=int,
                     help="requests allowed to wait for a row; past it the server answers 503 with "
                          "Retry-After (default: unbounded)")
    eng.add_argument("--prefix-cache-mb", type=float, default=256,
                     help="MiB of prompt prefixes' K/V kept for reuse: a request whose prompt starts with whole "
                          "pages another already ran (a shared system prompt) runs only the rest; 0 turns it off")
    eng.add_argument("--max-length", type=int,
                     help="positions per row, prompt + new tokens (default: the model's max_position_embeddings)")
    eng.add_argument("--speedup", type=float,
                     help="theoretical speedup for requests that name neither speedup nor policy "
                          "(default: the artifact's policy)")
    eng.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    eng.add_argument("--device", help="cpu, cuda or cuda:N, as in `python -m runtime` (default: the backend's)")
    eng.add_argument("--engine-dir", help="TensorRT engines (tensorrt backend; default: DIR/engines)")
    eng.add_argument("--threads", type=int, help="intra-op threads (default: ONNX Runtime's)")
    cli.add_spin(eng)
    cli.add_huge_pages(eng, default="auto")
    cli.add_fused(eng)
    cli.add_compile_steps(eng)
    cli.add_int4_kernel(eng)
    ray = p.add_argument_group("replicas (Ray Serve; needs the serve extra)")
    ray.add_argument("--replicas", type=int,
                     help="serve from N replicas, each with its own Generator on its own device (one GPU "
                          "each where Ray sees GPUs, else --threads CPU threads each), behind Ray "
                          "Serve's HTTP proxy; default: one Generator in this process, no Ray")
    ray.add_argument("--ray-address",
                     help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting a "
                          "local one; implies --replicas 1 unless given")
    return p


def check_args(args) -> None:
    """Arguments argparse cannot check, before any work (and --api-key's default, the environment's)."""
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV)
    if not 0 <= args.port <= 65535:
        raise SkipDecodeError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_batch", "threads", "replicas"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SkipDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_queue is not None and args.max_queue < 0:
        raise SkipDecodeError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.prefix_cache_mb < 0:
        raise SkipDecodeError(f"--prefix-cache-mb must be >= 0 (0 turns prompt reuse off), got {args.prefix_cache_mb:g}")
    if args.api_key is not None and not args.api_key.strip():
        raise SkipDecodeError(f"--api-key (or ${API_KEY_ENV}) is empty; give a key, or unset it for no key")
    if args.device and args.backend == "tensorrt":
        raise SkipDecodeError("--device does not apply to the tensorrt backend (its engines were built for a GPU)")
    if args.engine_dir and args.backend != "tensorrt":
        raise SkipDecodeError("--engine-dir applies only to --backend tensorrt")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a SkipDecodeError saying why there is none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise SkipDecodeError(f"--host {host!r} is not an address of this machine ({exc}); use "
                              f"127.0.0.1, 0.0.0.0 or one of its interfaces' addresses") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may rebind at once
        sock.bind(address)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        hint = ("another process listens there: pick another --port, or stop that process"
                if exc.errno == 98 else "pick another --host / --port")
        raise SkipDecodeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; {hint}") from None
    return sock
