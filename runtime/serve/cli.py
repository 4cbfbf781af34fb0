"""``python -m runtime serve ARTIFACT [--port 8000] [--max-batch 8] [--speedup 2] ...``."""

from __future__ import annotations

import argparse
import sys

from .. import cli
from ..errors import SkipDecodeError
from ..generator import DEFAULT_PREFILL_CHUNK

MISSING_EXTRA = ("error: `python -m runtime serve` needs the serve extra ({missing}); install it with "
                 "pip install -e \".[serve]\" (or: pip install starlette uvicorn)")


def parser() -> argparse.ArgumentParser:
    p = cli.parser(  # --version, defaults in --help, as every CLI of the toolkit
        "python -m runtime serve",
        "Serve an exported artifact over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/models, /health). Concurrent requests are batched by the "
                    "engine, each with its own SkipDecode policy. There is no chat endpoint: OPT has "
                    "no chat template.")
    p.add_argument("directory", help="artifact directory written by `python -m export build`")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int,
                   help="rows decoded together: KV rows (default 8, or the backend's limit if lower); "
                        "a step costs the rows that run, not the rows it could hold")
    cli.add_prefill_chunk(p, DEFAULT_PREFILL_CHUNK)
    p.add_argument("--max-queue", type=int,
                   help="requests allowed to wait for a row; past it the server answers 503 with "
                        "Retry-After (default: unbounded)")
    p.add_argument("--max-length", type=int,
                   help="positions per row, prompt + new tokens (default: the model's max_position_embeddings)")
    p.add_argument("--speedup", type=float,
                   help="theoretical speedup for requests that name neither speedup nor policy "
                        "(default: the artifact's policy)")
    p.add_argument("--model-name", help="model id in /v1/models and responses (default: the directory's name)")
    p.add_argument("--backend", default="onnxruntime", help="onnxruntime (default), torch or tensorrt")
    p.add_argument("--threads", type=int, help="intra-op threads (default: ONNX Runtime's)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight before cancelling them (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    return p


def main(argv=None, load=None) -> int:
    """Run the server until SIGTERM or Ctrl-C; 0 after a graceful shutdown.

    ``load`` replaces ``runtime.load`` (tests wrap the backend with it)."""
    args = parser().parse_args(argv)
    try:
        import uvicorn

        from .app import ServeConfig, create_app
        from .server import GracefulServer
    except ImportError as exc:
        print(MISSING_EXTRA.format(missing=exc.name or exc), file=sys.stderr)
        return 2
    if load is None:
        from ..generator import load
    try:
        gen = load(args.directory, backend=args.backend, threads=args.threads, max_batch=args.max_batch,
                   max_queue=args.max_queue, max_length=args.max_length, prefill_chunk=args.prefill_chunk)
    except (SkipDecodeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            gen.policy_for(16, speedup=args.speedup)  # a bad --speedup fails now, not per request
        except SkipDecodeError as exc:
            print(f"error: --speedup: {exc}", file=sys.stderr)
            return 2
        default = f"speedup {args.speedup:g}" if args.speedup else f"the artifact's {gen.manifest.policy}"
        config = ServeConfig(model_name=args.model_name, speedup=args.speedup,
                             shutdown_timeout=args.shutdown_timeout, close_generator=False)
        app = create_app(gen, config)
        print(f"serving {app.state.server.model_id!r} ({gen.num_layers} layers, max_batch "
              f"{gen.max_batch}, default policy: {default}) on http://{args.host}:{args.port}", flush=True)
        server = GracefulServer(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=not args.no_access_log,
            lifespan="on", timeout_graceful_shutdown=args.shutdown_timeout))
        server.run()
        return 0 if server.started else 1
    finally:
        # Requests still running were cancelled by uvicorn after --shutdown-timeout.
        gen.close(cancel=True, timeout=args.shutdown_timeout)
