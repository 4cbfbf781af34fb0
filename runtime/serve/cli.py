"""``python -m runtime serve ARTIFACT [--port 8000] [--max-batch 8] [--speedup 2] [--replicas N] ...``.

Every startup error (a bad option, a port in use, a host that does not resolve, a broken artifact)
is one ``error:`` line and exit 2, before anything claims to be serving: the listening socket is
bound before the model loads, and "serving on" is printed once it is."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .. import cli
from ..backends import BACKENDS
from ..errors import SkipDecodeError
from ..generator import DEFAULT_PREFILL_CHUNK

MISSING_EXTRA = ("error: `python -m runtime serve` needs the serve extra ({missing}); install it with "
                 "pip install -e \".[serve]\"")
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
    eng.add_argument("--max-queue", type=int,
                     help="requests allowed to wait for a row; past it the server answers 503 with "
                          "Retry-After (default: unbounded)")
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


def backend_options(args) -> dict:
    from ..__main__ import _backend_options  # the same --device/--engine-dir/--threads as python -m runtime

    return _backend_options(args)


def main(argv=None, load=None) -> int:
    """Run the server until SIGTERM or Ctrl-C; 0 after a graceful shutdown.

    ``load`` replaces ``runtime.load`` (tests wrap the backend with it)."""
    args = parser().parse_args(argv)
    try:
        import uvicorn  # noqa: F401

        from .app import ServeConfig  # noqa: F401 - the extra's packages, all of them, before any work
        from .server import GracefulServer  # noqa: F401
    except ImportError as exc:
        print(MISSING_EXTRA.format(missing=exc.name or exc), file=sys.stderr)
        return 2
    if args.replicas is not None or args.ray_address is not None:
        from .replicas import main as replicas_main

        return cli.run(lambda: replicas_main(args))
    return cli.run(lambda: _serve(args, load))


def _serve(args, load) -> int:
    import uvicorn

    from .app import ServeConfig, create_app
    from .server import GracefulServer

    check_args(args)
    if load is None:
        from ..generator import load
    sock = bind(args.host, args.port)
    try:
        try:
            gen = load(args.directory, backend=args.backend, max_batch=args.max_batch, max_queue=args.max_queue,
                       max_length=args.max_length, prefill_chunk=args.prefill_chunk, **backend_options(args))
        except ValueError as exc:  # an argument check of load's that is not a SkipDecodeError
            raise SkipDecodeError(str(exc)) from None
        try:
            try:
                gen.policy_for(16, speedup=args.speedup)  # a bad --speedup fails now, not per request
            except SkipDecodeError as exc:
                raise SkipDecodeError(f"--speedup: {exc}") from None
            config = ServeConfig.from_args(args)
            app = create_app(gen, config)
            port = sock.getsockname()[1]
            default = f"speedup {args.speedup:g}" if args.speedup else f"the artifact's {gen.manifest.policy}"
            print(f"serving {app.state.server.model_id!r} ({gen.num_layers} layers, max_batch "
                  f"{gen.max_batch}, default policy: {default}) on http://{args.host}:{port}"
                  f"{' (API key required)' if args.api_key else ''}", flush=True)
            server = GracefulServer(uvicorn.Config(
                app, log_level=args.log_level, access_log=not args.no_access_log, lifespan="on",
                timeout_graceful_shutdown=args.shutdown_timeout))
            server.run(sockets=[sock])
            return 0 if server.started else 1
        finally:
            # Requests still running were cancelled by uvicorn after --shutdown-timeout.
            gen.close(cancel=True, timeout=args.shutdown_timeout)
    finally:
        sock.close()
